"""`LocalBackend(in_process=False)`: the server in a child process, driven as a RemoteBackend.

ART's own LocalBackend runs its model service in a child process by default. With
`in_process=False`, tempering does the same: `tempering serve` runs in a child process on
127.0.0.1 with a generated API key, and this process talks to it over HTTP. The engine and the
trainer then have their own process (their own GIL, their own crash), apart from the user's
code. The child stops when the backend is closed or this process exits. Its output goes to
`<path>/server.log`.

It is not faster on the workloads measured. On an H100, `benchmarks/rl_loop.py --child-process`
gave a pipelined iteration of 10.97 s against 11.29 s in-process, and a sequential one of 17.03 s
against 13.73 s: a train call sends its trajectories over HTTP. See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from ..engine import EngineConfig
from ..errors import BackendError
from .art_mapping import as_engine_config
from .local import DEFAULT_ROOT, check_local_options
from .remote import RemoteBackend

__all__ = ["ChildProcessBackend"]


class ChildProcessBackend(RemoteBackend):
    """A `tempering serve` child process and the RemoteBackend that drives it.

    Made by `LocalBackend(in_process=False, ...)`, with LocalBackend's arguments. `gpus`, `device`,
    `engine_config` (or `max_batch_size`) and `path` go to the child. `host`/`port` are where it
    listens (default 127.0.0.1 and a free port). `api_key` is the key it requires (default: a
    generated one).

    Raises:
        BackendError: if the child exits before it serves, or is not serving after
            `startup_timeout_s`. The message ends with the tail of its log.
    """

    def __init__(
        self,
        *,
        path: str | Path | None = None,
        device: str | None = None,
        gpus: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_batch_size: int = 256,
        engine_config: EngineConfig | dict | None = None,
        gpu_cost_per_hour_usd: float | None = None,
        enable_expert_replay: bool = True,
        dedicated: bool = False,
        startup_timeout_s: float = 600.0,
    ) -> None:
        check_local_options(gpus=gpus, gpu_cost_per_hour_usd=gpu_cost_per_hour_usd,
                            enable_expert_replay=enable_expert_replay)
        root = Path(path) if path is not None else DEFAULT_ROOT
        root.mkdir(parents=True, exist_ok=True)
        self.path = root  # the storage root, on this machine (as LocalBackend.path)
        self.log_path = root / "server.log"
        from ..service.auth import generate_api_key  # with the HTTP stack, which only a serving process needs

        api_key = api_key or generate_api_key()
        port = port or _free_port(host)
        engine_config = as_engine_config(engine_config, max_batch_size)
        command = [sys.executable, "-m", "tempering.cli", "serve", "--host", host, "--port", str(port),
                   "--root", str(root), "--gpus", str(gpus), "--engine-config", json.dumps(dataclasses.asdict(engine_config))]
        if device is not None:
            command += ["--device", device]
        if dedicated:
            command += ["--dedicated"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            env={**os.environ, "TEMPERING_API_KEY": api_key})
        self._stop = weakref.finalize(self, _stop_process, self.process)  # also at exit, if never closed
        super().__init__(f"http://{host}:{port}", api_key, timeout_s=600.0)
        try:
            self._wait_until_serving(startup_timeout_s)
        except BaseException:
            self._stop()
            raise

    def _wait_until_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self._api_key}"}
        while True:
            if self.process.poll() is not None:
                raise BackendError(f"the tempering server process exited with code {self.process.returncode} before "
                                   f"serving; {self._log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", headers=headers, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BackendError(f"the tempering server process is not serving after {timeout_s:.0f} s; {self._log_tail()}")
            time.sleep(0.2)

    def _log_tail(self, num_chars: int = 2000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return f"its log {self.log_path} cannot be read"
        return f"its log {self.log_path} ends with:\n{text}"

    def _check_server(self) -> None:
        """Raise BackendError, with the child's exit code and log tail, if it has exited."""
        if self.process.poll() is not None and not self._closed:
            raise BackendError(f"the tempering server process exited with code {self.process.returncode}; "
                               f"{self._log_tail()}")

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        self._check_server()
        return await super()._request(method, path, **kwargs)

    async def close(self) -> None:
        """Stop the child process (its models are saved at each step) and close the connections."""
        await super().close()
        await asyncio.to_thread(self._stop)  # waits for the child to shut down (up to 30 s, then SIGKILL)

    def __enter__(self) -> ChildProcessBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop_process(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGINT (uvicorn shuts down and the hub closes its models), then SIGKILL after `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
