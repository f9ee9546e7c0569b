"""`log_http_errors`: log an HTTP error response's status, URL and body before it propagates (ART's `art.utils`)."""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["log_http_errors"]

log = logging.getLogger("tempering")

F = TypeVar("F", bound=Callable[..., Any])

MAX_BODY_CHARS = 2000  # enough for a server's error detail; a long HTML error page is cut


def log_http_errors(func: F) -> F:
    """Decorator: when `func` raises an HTTP status error, log it with the response body and re-raise it.

    An HTTP status error is any exception with a `.response` that has an integer `status_code`:
    `httpx.HTTPStatusError` (from `response.raise_for_status()`), the openai SDK's
    `APIStatusError` family (`NotFoundError`, `RateLimitError`, ...), and `requests.HTTPError`.
    The log line (logger "tempering", level ERROR) and a note added to the exception read
    `[HTTP <status>] <method> <url>: <detail>`, where detail is the JSON body's "detail" field
    when it has one (FastAPI's errors, tempering's server), else the body text (at most
    2,000 characters). The exception itself propagates unchanged, so `except` clauses keep
    working. (ART's decorator instead raises a bare `Exception` with that text.) Other
    exceptions pass through untouched. Works on sync and async functions.

        @art.utils.log_http_errors
        async def fetch_scores(client: httpx.AsyncClient) -> dict: ...
    """
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await func(*args, **kwargs)
            except Exception as exc:
                _report(exc, func)
                raise

        return run_async  # type: ignore[return-value]

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            _report(exc, func)
            raise

    return run  # type: ignore[return-value]


def _report(exc: Exception, func: Callable[..., Any]) -> None:
    """Log `exc` and add a note to it, if it is an HTTP status error."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if not isinstance(status, int) or isinstance(status, bool):
        return
    summary = f"[HTTP {status}] {_request_line(exc, response)}: {_detail(response)}"
    log.error("%s raised %s %s", getattr(func, "__qualname__", func), type(exc).__name__, summary)
    exc.add_note(summary)


def _request_line(exc: Exception, response: Any) -> str:
    """`METHOD URL` of the failed request, as far as the exception or response knows it."""
    for owner in (exc, response):
        try:  # httpx raises RuntimeError for a response built without a request
            request = getattr(owner, "request", None)
        except RuntimeError:
            request = None
        if request is not None and getattr(request, "url", None) is not None:
            return f"{getattr(request, 'method', '')} {request.url}".strip()
    return str(getattr(response, "url", "") or "(unknown URL)")


def _detail(response: Any) -> str:
    try:
        text = response.text
    except Exception:  # a streamed response whose body was never read
        return "(body not read)"
    try:
        body = json.loads(text)
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and "detail" in body:
        text = body["detail"] if isinstance(body["detail"], str) else json.dumps(body["detail"])
    text = str(text or "(empty body)")
    return text if len(text) <= MAX_BODY_CHARS else text[:MAX_BODY_CHARS] + "…"
