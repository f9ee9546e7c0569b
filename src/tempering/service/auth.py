"""Bearer-key authentication for every route."""

from __future__ import annotations

import hmac
import secrets

from fastapi import HTTPException, Request

__all__ = ["generate_api_key", "require_api_key"]


def generate_api_key() -> str:
    return "tmp-" + secrets.token_urlsafe(24)


def require_api_key(expected: str | None):
    """A FastAPI dependency that checks `Authorization: Bearer <key>` in constant time.

    `expected=None` turns authentication off (only for servers bound to loopback on request).

    Raises:
        ValueError: for an empty or blank key, which an empty bearer token would match.
    """
    if expected is not None and not expected.strip():
        raise ValueError("the API key is empty; pass a non-empty key, or None (no authentication, loopback only)")

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), expected.encode()):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
