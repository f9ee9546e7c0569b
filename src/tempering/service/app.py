"""The FastAPI app of a tempering server: OpenAI routes behind a bearer key, OpenAI-style errors."""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ConfigError, EngineError, TemperingError, UnknownModelError
from .auth import require_api_key
from .openai_routes import build_openai_router
from .registry import ServiceRegistry

__all__ = ["create_app"]

log = logging.getLogger("tempering")


def _error(status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": code}},
    )


def create_app(registry: ServiceRegistry, *, api_key: str | None) -> FastAPI:
    """The app serving `registry`'s models; every route requires `api_key` (None: no auth)."""
    app = FastAPI(title="tempering", summary="OpenAI-compatible inference for models being trained with RL")
    auth = [Depends(require_api_key(api_key))]
    app.include_router(build_openai_router(registry), dependencies=auth)

    @app.get("/health", dependencies=auth)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.exception_handler(UnknownModelError)
    async def _unknown_model(request: Request, exc: UnknownModelError) -> JSONResponse:
        return _error(404, str(exc), type_="invalid_request_error", param="model", code="model_not_found")

    @app.exception_handler(ConfigError)
    async def _bad_config(request: Request, exc: ConfigError) -> JSONResponse:
        return _error(400, str(exc), type_="invalid_request_error")

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        log.error("engine error on %s: %s", request.url.path, exc)
        return _error(503, str(exc), type_="server_error")

    @app.exception_handler(TemperingError)
    async def _tempering(request: Request, exc: TemperingError) -> JSONResponse:
        return _error(400, str(exc), type_="invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error(422, "invalid request: " + "; ".join(problems), type_="invalid_request_error", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _error(exc.status_code, str(exc.detail), type_="invalid_request_error")
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return _error(500, f"internal error: {exc!r}", type_="server_error")

    return app
