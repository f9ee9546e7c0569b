"""A connection to an MCP server that many concurrent rollouts can share.

`connect(server)` takes what `mcp.Client` takes: a URL (streamable HTTP), `StdioServerParameters`
(or a command line as a list of strings) to start a server as a subprocess speaking stdio, an
in-process `MCPServer`, or any MCP transport. The SDK's client runs in a task of its own, so a
transport that fails cancels that task only, never the rollouts calling tools or the gather around
them: every call in flight, and every later one, raises MCPConnectionError naming the server and
quoting the end of its stderr (stdio servers' stderr is kept in a temporary file for that).

Errors (each also the stdlib error it stands for)::

    TemperingError
    └── MCPConnectionError(ConnectionError)  the server cannot be reached, closed the connection
                                             (exited, was killed) or did not answer within timeout_s

A tool that fails, or rejects its arguments, is not a connection error: `call_tool` returns a
ToolResult with `is_error=True` and the server's message, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import mcp
import mcp.types
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError

from ...errors import BackendError, TemperingError
from .types import MCPResource, MCPTool

__all__ = ["MCPConnection", "MCPConnectionError", "ToolResult", "connect"]

T = TypeVar("T")

_CONNECTION_CLOSED = -32000  # JSON-RPC codes the SDK uses (mcp_types.jsonrpc)
_REQUEST_TIMEOUT = -32001
_STDERR_TAIL_BYTES = 1500


class MCPConnectionError(TemperingError, ConnectionError):
    """An MCP server that cannot be reached, closed the connection, or did not answer in time."""


@dataclass(slots=True)
class ToolResult:
    """What a tool call gave: its text (text content joined; other content described) and whether it failed."""

    text: str
    is_error: bool


def result_text(content: Sequence[Any]) -> str:
    """Text of MCP content blocks: text as is, resources by their text or URI, other media by type."""
    parts = []
    for block in content:
        if isinstance(block, mcp.types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp.types.EmbeddedResource):
            parts.append(getattr(block.resource, "text", None) or f"[resource {block.resource.uri}]")
        else:
            parts.append(f"[{getattr(block, 'type', type(block).__name__)} content: {getattr(block, 'mime_type', '')}]")
    return "\n".join(parts)


class MCPConnection:
    """One MCP client session, entered with `async with` and shared by concurrent rollouts.

    Args:
        server: a URL, `mcp.StdioServerParameters`, a command line (list of strings) run over
            stdio, an in-process `mcp.server.mcpserver.MCPServer`, or an MCP transport.
        timeout_s: how long one request may take before MCPConnectionError.
        errlog: where a stdio server's stderr goes; default a temporary file whose end is quoted
            in errors.

    Every request (list_tools, list_resources, read_resource, call_tool) raises
    MCPConnectionError if the server is gone or does not answer within timeout_s, and
    BackendError if the connection is used outside its `async with` block.
    """

    def __init__(self, server: Any, *, timeout_s: float = 60.0, errlog: IO[str] | None = None) -> None:
        if isinstance(server, Sequence) and not isinstance(server, str):
            if not server:
                raise MCPConnectionError("an MCP server command line needs at least the program to run")
            server = mcp.StdioServerParameters(command=str(server[0]), args=[str(a) for a in server[1:]])
        self.server = server
        self.timeout_s = timeout_s
        self.name = _describe(server)
        self._own_errlog = errlog is None and isinstance(server, mcp.StdioServerParameters)
        self._errlog = tempfile.TemporaryFile("w+") if self._own_errlog else errlog
        self._client: mcp.Client | None = None
        self._owner: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._closing = asyncio.Event()
        self._dead = asyncio.Event()
        self._failure: BaseException | None = None
        self._state = "new"

    async def __aenter__(self) -> MCPConnection:
        if self._state != "new":
            raise BackendError(f"this connection to {self.name} was already opened; make a new one with connect()")
        self._state = "open"
        self._owner = asyncio.create_task(self._own(), name=f"mcp connection to {self.name}")
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait({self._owner, ready}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if not self._ready.is_set():
            error = MCPConnectionError(f"could not connect to the MCP server {self.name}: {_reason(self._failure)}"
                                       f"{self._stderr_tail()}")
            await self.close()
            raise error from self._failure
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the session (and stop a stdio server). Safe to call twice."""
        self._state = "closed"
        self._closing.set()
        if self._owner is not None:
            await asyncio.gather(self._owner, return_exceptions=True)
        if self._own_errlog and self._errlog is not None:
            self._errlog.close()
            self._errlog = None

    async def _own(self) -> None:
        """Hold the SDK's client open until close(); a transport failure ends this task only."""
        server = self.server
        if isinstance(server, mcp.StdioServerParameters) and self._errlog is not None:
            server = stdio_client(server, errlog=self._errlog)
        try:
            async with mcp.Client(server, read_timeout_seconds=self.timeout_s) as client:
                self._client = client
                self._ready.set()
                await self._closing.wait()
        except Exception as exc:  # the transport failed (the SDK raises an ExceptionGroup here)
            self._failure = exc
        finally:
            self._dead.set()

    @property
    def is_alive(self) -> bool:
        """Whether requests can still be sent (opened, not closed, the server not gone)."""
        return self._state == "open" and not self._dead.is_set() and self._failure is None

    async def list_tools(self) -> list[MCPTool]:
        """All the server's tools (every page)."""
        tools: list[MCPTool] = []
        cursor = None
        while True:
            page = await self._request("tools/list", lambda c=cursor: self._session().list_tools(cursor=c))
            tools += [MCPTool.from_mcp(t) for t in page.tools]
            cursor = page.next_cursor
            if cursor is None:
                return tools

    async def list_resources(self) -> list[MCPResource]:
        """All the server's resources (every page); empty when it offers none."""
        client = self._session()
        if client.server_capabilities.resources is None:
            return []
        resources: list[MCPResource] = []
        cursor = None
        while True:
            page = await self._request("resources/list", lambda c=cursor: client.list_resources(cursor=c))
            resources += [MCPResource.from_mcp(r) for r in page.resources]
            cursor = page.next_cursor
            if cursor is None:
                return resources

    async def read_resource(self, uri: str) -> str:
        """A resource's text (binary parts described by their MIME type)."""
        result = await self._request(f"resources/read {uri}", lambda: self._session().read_resource(uri))
        return "\n".join(getattr(c, "text", None) or f"[binary {c.mime_type}]" for c in result.contents)

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        """Call a tool.

        Returns:
            the result; a tool that failed or rejected its arguments gives `is_error=True` with the
            server's message (the server keeps serving).

        Raises:
            MCPConnectionError: if the connection is gone or the server did not answer within timeout_s.
        """
        try:
            result = await self._request(f"the call of tool {name!r}", lambda: self._session().call_tool(name, arguments or {}))
        except MCPError as error:  # a protocol-level refusal (unknown tool, bad params) from a low-level server
            return ToolResult(f"Error: {error.message}", True)
        return ToolResult(result_text(result.content), bool(result.is_error))

    def _session(self) -> mcp.Client:
        if self._state != "open":
            raise BackendError(f"the connection to {self.name} is {'not open yet' if self._state == 'new' else 'closed'}; "
                               "use it inside `async with connect(server) as connection:`")
        if not self.is_alive or self._client is None:
            raise self._gone("a request")
        return self._client

    async def _request(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run one request, failing with MCPConnectionError as soon as the connection dies."""
        self._session()
        request = asyncio.ensure_future(make())
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait({request, dead}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            request.cancel()
            raise
        finally:
            dead.cancel()
        if not request.done():
            request.cancel()
            raise self._gone(what)
        try:
            return request.result()
        except MCPError as error:
            if error.code == _CONNECTION_CLOSED:
                self._failure = self._failure or error
                raise self._gone(what) from error
            if error.code == _REQUEST_TIMEOUT:
                raise MCPConnectionError(f"the MCP server {self.name} did not answer {what} within {self.timeout_s} s "
                                     "(timeout_s)") from error
            raise

    def _gone(self, what: str) -> MCPConnectionError:
        return MCPConnectionError(f"the MCP server {self.name} closed the connection (it exited or was stopped) before "
                              f"answering {what}: {_reason(self._failure)}; open a new connection to go on"
                              f"{self._stderr_tail()}")

    def _stderr_tail(self) -> str:
        if not self._own_errlog or self._errlog is None:
            return ""
        fd = self._errlog.fileno()
        size = os.fstat(fd).st_size
        tail = os.pread(fd, _STDERR_TAIL_BYTES, max(0, size - _STDERR_TAIL_BYTES)).decode(errors="replace").strip()
        return f"\n--- end of the server's stderr ---\n{tail}" if tail else ""


def connect(server: Any, *, timeout_s: float = 60.0, errlog: IO[str] | None = None) -> MCPConnection:
    """A connection to an MCP server, to open with `async with connect(server) as connection:`.

    See MCPConnection for the arguments. Raises MCPConnectionError on entry if the server cannot be reached.
    """
    return MCPConnection(server, timeout_s=timeout_s, errlog=errlog)


def _describe(server: Any) -> str:
    if isinstance(server, str):
        return server
    if isinstance(server, mcp.StdioServerParameters):
        return repr(" ".join([server.command, *server.args]))
    return repr(getattr(server, "name", None) or type(server).__name__)


def _reason(failure: BaseException | None) -> str:
    """The innermost errors of what ended the connection (the SDK wraps them in exception groups)."""
    if failure is None:
        return "no reason given"
    if isinstance(failure, BaseExceptionGroup):
        return "; ".join(_reason(e) for e in failure.exceptions)
    return f"{type(failure).__name__}: {failure}"
