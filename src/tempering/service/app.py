"""The FastAPI app of a tempering server: OpenAI routes (and, on a server, training routes) behind a
bearer key, request bodies under a size limit, OpenAI-style errors. The OpenAPI spec is served at
`/openapi.json` (with the key, like every route)."""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ConfigError, EngineError, TemperingError, UnknownModelError
from .auth import require_api_key
from .jobs import TrainingConflict
from .openai_routes import build_model_lookup_router, build_openai_router
from .registry import ServiceRegistry

__all__ = ["create_app"]

log = logging.getLogger("tempering")


def _error(status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": code}},
    )


def _path(loc: tuple) -> str:
    """A validation error's location as a JSON path: `messages[1].tool_calls[0].function.name`."""
    path = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


class InternalErrors:
    """ASGI middleware: an unexpected error becomes a logged 500 (OpenAI's error shape) that keeps
    the client's connection open. Starlette's own 500 handler re-raises after responding, and
    uvicorn then closes the keep-alive connection; this one, inside it, does not. An error after
    the response started (a stream) still propagates."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            if started:
                raise
            log.exception("unexpected error on %s", scope.get("path"))
            await _error(500, f"internal error: {exc!r}", type_="server_error")(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before the route reads it."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        response = _error(413, f"request body over the server's limit of {self.max_bytes} bytes",
                          type_="invalid_request_error", code="request_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(response.body)).encode())]})
        await send({"type": "http.response.body", "body": response.body})


class _TooLarge(Exception):
    pass


def create_app(
    registry: ServiceRegistry,
    *,
    api_key: str | None,
    hub=None,
    jobs=None,
    adapters=None,
    max_body_bytes: int = 64 << 20,
) -> FastAPI:
    """The app serving `registry`'s models; with `hub` and `jobs` also the training routes; with
    `adapters` (an AdapterServer, also the registry) the routes that add and remove its adapters.

    Every route requires `api_key` (None: no auth, only for loopback servers).
    """
    app = FastAPI(
        title="tempering",
        summary="OpenAI-compatible inference and RL training of LoRA adapters",
        description="Send `Authorization: Bearer <key>` with every request.",
        docs_url=None, redoc_url=None, openapi_url=None,
    )
    auth = [Depends(require_api_key(api_key))]
    app.include_router(build_openai_router(registry), dependencies=auth)
    if hub is not None and jobs is not None:
        from .train_routes import build_train_router

        app.include_router(build_train_router(hub, jobs), dependencies=auth)
    if adapters is not None:
        from .adapter_routes import build_adapter_router

        app.include_router(build_adapter_router(adapters), dependencies=auth)
    app.include_router(build_model_lookup_router(registry), dependencies=auth)  # last: its id is the rest of the path

    @app.get("/health", dependencies=auth)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi() -> dict:
        return app.openapi()

    @app.exception_handler(TrainingConflict)
    async def _conflict(request: Request, exc: TrainingConflict) -> JSONResponse:
        return _error(409, str(exc), type_="conflict", code="training_in_progress")

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
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            message = f"request body is not valid JSON: {first.get('ctx', {}).get('error')} at char {first['loc'][-1]}"
            return _error(422, message, type_="invalid_request_error")
        if isinstance(first.get("input"), bytes):  # FastAPI parses the body as JSON only when it is declared so
            return _error(422, "the request body must be a JSON object; send it with Content-Type: application/json",
                          type_="invalid_request_error")
        problems = []
        for err in errors:
            where, message = _path(err.get("loc", ())), str(err.get("msg")).removeprefix("Value error, ")
            problems.append(f"{where} is required" if err.get("type") == "missing" else f"{where}: {message}" if where else message)
        return _error(422, "invalid request: " + "; ".join(problems), type_="invalid_request_error",
                      param=_path(first.get("loc", ())) or None)

    @app.exception_handler(TemplateError)
    async def _template(request: Request, exc: TemplateError) -> JSONResponse:
        return _error(400, f"the model's chat template cannot render these messages: {exc}", type_="invalid_request_error",
                      param="messages")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _error(exc.status_code, str(exc.detail), type_="invalid_request_error",
                          param=getattr(exc, "param", None))  # request_checks.BadParam names the field
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(InternalErrors)  # added last: the outermost, so every unexpected error passes through it
    return app
