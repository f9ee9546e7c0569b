"""Run the FastAPI app with uvicorn in a background thread (what LocalBackend uses)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from ..errors import BackendError

__all__ = ["ServerThread"]


class ServerThread:
    """uvicorn serving `app` on `host:port` (port 0: a free one) from a daemon thread.

    The socket is bound before the thread starts, so `port` is known at once and no other
    process can take it in between.
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise BackendError(f"cannot listen on {host}:{port}: {exc}; choose another port") from exc
        self.host = host
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="tempering-server", daemon=True
        )

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise BackendError("the tempering server thread exited during start-up; see the log above")
            if time.monotonic() > deadline:
                raise BackendError(f"the tempering server did not start within {timeout_s} s")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 10.0, *, grace_s: float | None = None) -> None:
        """Stop serving: uvicorn's graceful shutdown (no new connections, open requests finish) for
        `grace_s` (default: half of `timeout_s`), then a forced one, which drops the connections
        still open (a client's kept-alive connection could otherwise be answered for as long as it
        keeps sending). Returns within about `timeout_s`."""
        grace_s = timeout_s / 2 if grace_s is None else min(grace_s, timeout_s)
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(grace_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(max(timeout_s - grace_s, 0.1))
        self._socket.close()
