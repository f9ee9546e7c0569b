"""httpx transports that hand every chat completion a client makes to the listeners in context.

A capturing transport wraps the real one (it is the openai SDK's own seam: `AsyncOpenAI(http_client=...)`,
no patching of httpx or openai). For a `POST .../chat/completions` made while listeners are in
context (`listen(...)`, as `capture_auto_trajectory` and tracing do), each listener is told of
the request when it is sent (in the sender's context: its capture scope, its tracing span), the
response body is copied as the client reads it, and when the client closes the response,
streamed or not, the request and its first choice go back to each listener as an `Exchange`.
Outside any listener the transport only forwards.

`model.openai_client()` is built on `capturing_http_client()`; `capture_client(client)` gives
any other `openai` client the same transport.

The HTTP library is the one the installed openai SDK is built on: httpx2 for openai >= 3 (its
fork of httpx), httpx for 1.x and 2.x (which take nothing else). It matters for RL's burst of
concurrent rollouts: httpx 0.28's connection pool (httpcore 1.0) scans every connection for every
queued request whenever one starts or ends, where httpx2's does not. 256 concurrent completions
of 4 tokens through a kept-alive pool (tiny model, 2-core CPU, `.scratch`-style probe) took 5.7 s
through httpx and 1.8 s through httpx2, whose first request reached the engine after 0.8 s
instead of 2.6 s. httpx2's pool still walks all its connections at each start and end, so the
default transport spreads the requests over several pools (`ShardedPoolTransport`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any, Protocol, TypeVar

from ..types import Choice
from .parse import parse_chat_completion

__all__ = [
    "AsyncCaptureTransport",
    "CaptureTransport",
    "Exchange",
    "Listener",
    "capture_client",
    "capturing_http_client",
    "capturing_sync_http_client",
    "listen",
]

logger = logging.getLogger(__name__)


def _http_library() -> ModuleType:
    """httpx2 where the installed openai SDK is built on it (openai >= 3), else httpx."""
    try:
        if int(version("openai").split(".")[0]) >= 3:
            import httpx2

            return httpx2
    except (PackageNotFoundError, ValueError, ImportError):
        pass
    import httpx

    return httpx


httpx = _http_library()

# the openai SDK's defaults (openai._constants), which httpx applies only to the transport it builds itself
_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=5.0)
_CLIENT_DEFAULTS: dict[str, Any] = {"timeout": httpx.Timeout(600.0, connect=5.0), "follow_redirects": True}


@dataclass(frozen=True, slots=True)
class Exchange:
    """One chat completion as a capturing transport saw it.

    Attributes:
        request: the JSON request body (`messages`, `tools`, `model`, sampling options).
        choice: the response's first choice, with every extra field the server sent (a tempering
            server's `token_ids`, `prompt_token_ids`, logprobs, `policy_versions`, ...).
        usage: the response's `usage` dict, when it sent one.
        start_s, end_s: wall-clock times (`time.time()`, seconds) the request was sent and the
            response closed.
    """

    request: dict[str, Any]
    choice: Choice
    usage: dict[str, Any] | None
    start_s: float
    end_s: float


class Listener(Protocol):
    """What `listen` takes: told when a chat completion is sent, and again when it is done."""

    def on_request(self, request: dict[str, Any]) -> Any:
        """Called in the sender's context (its capture scope, its tracing span); returns a handle."""

    def on_response(self, handle: Any, exchange: Exchange | None) -> None:
        """Called once, with `on_request`'s handle, when the response closed (`exchange`) or the
        request failed: an error status, a stream not read to its end, no response (None)."""


_listeners: contextvars.ContextVar[tuple[Listener, ...]] = contextvars.ContextVar("tempering_capture_listeners", default=())


@contextlib.contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Within the block (and tasks started from it), `listener` sees every captured chat completion."""
    token = _listeners.set((*_listeners.get(), listener))
    try:
        yield
    finally:
        _listeners.reset(token)


class _Pending:
    """A watched request, until its response closes."""

    def __init__(self, request: dict[str, Any], listeners: tuple[Listener, ...]) -> None:
        self.request = request
        self.start_s = time.time()
        self.is_done = False
        self.handles = [(listener, _safely(listener.on_request, request)) for listener in listeners]

    def fail(self) -> None:
        self._finish(None)

    def deliver(self, response: httpx.Response, raw: bytes) -> None:
        if self.is_done:
            return
        body = httpx.Response(response.status_code, headers=response.headers, stream=httpx.ByteStream(raw)).read()
        is_stream = response.headers.get("content-type", "").startswith("text/event-stream")
        parsed = parse_chat_completion(body, is_stream=is_stream)
        if parsed is None:
            logger.debug("a chat completion response held no finished choice; nothing captured")
        self._finish(Exchange(self.request, parsed[0], parsed[1], self.start_s, time.time()) if parsed else None)

    def _finish(self, exchange: Exchange | None) -> None:
        if self.is_done:
            return
        self.is_done = True
        for listener, handle in self.handles:
            _safely(listener.on_response, handle, exchange)


def _safely(method: Callable[..., Any], *args: Any) -> Any:
    try:
        return method(*args)
    except Exception:  # the user's request goes on: a failed listener must not break it
        logger.exception("a capture listener failed on a chat completion")
        return None


def _watch(request: httpx.Request) -> _Pending | None:
    listeners = _listeners.get()
    if not listeners or request.method != "POST" or not request.url.path.endswith("/chat/completions"):
        return None
    try:
        body = json.loads(request.content)
    except (httpx.RequestNotRead, ValueError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None
    return _Pending(body, listeners)


class _AsyncTee(httpx.AsyncByteStream):
    """Copies the body as it is read. The wrapped stream is iterated once: a second iteration (the
    openai SDK drains the body after `[DONE]`) goes on where the first stopped, as a network stream
    does, so a replayable stream (httpx's MockTransport, ASGITransport) is not copied twice."""

    def __init__(self, stream: httpx.AsyncByteStream, on_close: Callable[[bytes], None]) -> None:
        self.stream, self.on_close, self.chunks = stream, on_close, []
        self._iterator: AsyncIterator[bytes] | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._iterator is None:
            self._iterator = aiter(self.stream)
        async for chunk in self._iterator:
            self.chunks.append(chunk)
            yield chunk

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            self.on_close(b"".join(self.chunks))


class _SyncTee(httpx.SyncByteStream):
    """The synchronous twin of `_AsyncTee` (the wrapped stream is iterated once)."""

    def __init__(self, stream: httpx.SyncByteStream, on_close: Callable[[bytes], None]) -> None:
        self.stream, self.on_close, self.chunks = stream, on_close, []
        self._iterator: Iterator[bytes] | None = None

    def __iter__(self) -> Iterator[bytes]:
        if self._iterator is None:
            self._iterator = iter(self.stream)
        for chunk in self._iterator:
            self.chunks.append(chunk)
            yield chunk

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.on_close(b"".join(self.chunks))


def _teed(response: httpx.Response, pending: _Pending | None, tee: type) -> httpx.Response:
    if pending is None:
        return response
    if not 200 <= response.status_code < 300:
        pending.fail()
        return response
    stream = tee(response.stream, lambda raw: pending.deliver(response, raw))
    return httpx.Response(response.status_code, headers=response.headers, stream=stream, extensions=response.extensions)


class ShardedPoolTransport(httpx.AsyncBaseTransport):
    """httpx's own transport, `shards` times over, requests dealt to them in turn: `shards`
    connection pools that share the openai SDK's connection limits.

    A pool re-examines every one of its connections whenever a request starts or ends, so an RL
    batch's burst of N concurrent requests costs it O(N^2) Python calls; over K pools it costs
    O(N^2 / K). With 256 concurrent completions through one pool, py-spy put 4.8 s of a run of
    `benchmarks/endpoint_overhead.py --iterations 3` there (2.8 s median a gather, 2-core CPU).

    The pools share one SSL context: building one reads the system's CA certificates (28-34 ms
    each on a 2-core EPYC, `httpx.create_ssl_context()` timed five times).
    """

    def __init__(self, shards: int = 16, limits: httpx.Limits = _LIMITS) -> None:
        def per(n: int | None) -> int | None:  # a shard's part of a limit (None: no limit)
            return None if n is None else max(1, -(-n // shards))

        shard_limits = httpx.Limits(max_connections=per(limits.max_connections),
                                    max_keepalive_connections=per(limits.max_keepalive_connections),
                                    keepalive_expiry=limits.keepalive_expiry)
        ssl_context = httpx.create_ssl_context()
        self.shards = [httpx.AsyncHTTPTransport(verify=ssl_context, limits=shard_limits) for _ in range(shards)]
        self._next = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        shard = self.shards[self._next]
        self._next = (self._next + 1) % len(self.shards)
        return await shard.handle_async_request(request)

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.aclose()


class AsyncCaptureTransport(httpx.AsyncBaseTransport):
    """Forwards to `transport` (default: httpx's, with the openai SDK's connection limits, over
    several pools: `ShardedPoolTransport`) and hands each chat completion to the listeners in context."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.transport = transport or ShardedPoolTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pending = _watch(request)
        try:
            response = await self.transport.handle_async_request(request)
        except BaseException:
            if pending is not None:
                pending.fail()
            raise
        return _teed(response, pending, _AsyncTee)

    async def aclose(self) -> None:
        await self.transport.aclose()


class CaptureTransport(httpx.BaseTransport):
    """The synchronous twin of `AsyncCaptureTransport` (for `openai.OpenAI`)."""

    def __init__(self, transport: httpx.BaseTransport | None = None) -> None:
        self.transport = transport or httpx.HTTPTransport(limits=_LIMITS)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        pending = _watch(request)
        try:
            response = self.transport.handle_request(request)
        except BaseException:
            if pending is not None:
                pending.fail()
            raise
        return _teed(response, pending, _SyncTee)

    def close(self) -> None:
        self.transport.close()


def capturing_http_client(*, transport: httpx.AsyncBaseTransport | None = None, **kwargs: Any) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` for `openai.AsyncOpenAI(http_client=...)` (or LangChain's
    `ChatOpenAI(http_async_client=...)`) whose chat completions are captured.

    An httpx2 client with openai >= 3 (the SDK's own library), an httpx one with older SDKs
    (see the module docstring).

    Args:
        transport: the transport to wrap (default: httpx's own, with the openai SDK's
            connection limits).
        kwargs: other `httpx.AsyncClient` options; the openai SDK's defaults (timeout, redirects)
            apply to those not given.
    """
    return httpx.AsyncClient(transport=AsyncCaptureTransport(transport), **{**_CLIENT_DEFAULTS, **kwargs})


def capturing_sync_http_client(*, transport: httpx.BaseTransport | None = None, **kwargs: Any) -> httpx.Client:
    """The synchronous twin of `capturing_http_client` (for `openai.OpenAI`)."""
    return httpx.Client(transport=CaptureTransport(transport), **{**_CLIENT_DEFAULTS, **kwargs})


Client = TypeVar("Client")


def capture_client(client: Client) -> Client:
    """A copy of an `openai.AsyncOpenAI` / `openai.OpenAI` client whose chat completions are captured.

    The copy keeps the client's base URL, key, timeout, retries and headers; its HTTP client is a
    new capturing one (to keep a custom transport of yours, build the client with
    `http_client=capturing_http_client(transport=...)` instead).

    Raises:
        TypeError: if `client` is not an openai client.
    """
    from openai import AsyncOpenAI, OpenAI

    if isinstance(client, AsyncOpenAI):
        return client.with_options(http_client=capturing_http_client())  # type: ignore[return-value]
    if isinstance(client, OpenAI):
        return client.with_options(http_client=capturing_sync_http_client())  # type: ignore[return-value]
    raise TypeError(f"capture_client() takes an openai.AsyncOpenAI or openai.OpenAI client, got {type(client).__name__}")
