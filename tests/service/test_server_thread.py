"""The server thread stops within its timeout, even with a request that never finishes."""

import asyncio
import threading
import time

import httpx
from fastapi import FastAPI

from tempering.service.server import ServerThread


def test_stop_drops_a_request_still_open_after_the_grace_period():
    app = FastAPI()
    release = threading.Event()

    @app.get("/slow")
    async def slow():
        while not release.is_set():
            await asyncio.sleep(0.05)
        return {"ok": True}

    server = ServerThread(app)
    server.start()
    outcome: list = []

    def call():
        try:
            outcome.append(httpx.get(f"{server.base_url}/slow", timeout=30).status_code)
        except httpx.TransportError as exc:
            outcome.append(type(exc).__name__)

    client = threading.Thread(target=call)
    client.start()
    time.sleep(0.5)  # the request is in the app
    start = time.monotonic()
    server.stop(timeout_s=3.0, grace_s=1.0)
    elapsed = time.monotonic() - start
    try:
        assert not server._thread.is_alive() and elapsed < 3.5, elapsed  # a graceful stop alone waits forever
        client.join(10)
        assert outcome and outcome[0] != 200, outcome  # the open request was dropped, not answered
    finally:
        release.set()
        client.join(10)
