"""Starting the processes of a multi-GPU run and joining them in torch.distributed, torchrun-style.

One process per GPU: rank r computes on `cuda:LOCAL_RANK` (or, for tests, on the CPU with gloo).
The driver (rank 0) is the process the user started (`tempering serve --gpus N`,
`LocalBackend(gpus=N)`, a benchmark). `Driver.start` launches ranks 1..N-1 as child processes
with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so a worker starts the same way under `torchrun`, where `Driver.from_env` takes
rank 0's place.

Rendezvous goes through a `torch.distributed.TCPStore` (hosted by the driver, or by torchrun's
agent): the driver publishes the address and key of its control listener there; each worker
connects its channel (channel.py), and only then does every rank join the process group (NCCL
on GPUs, gloo on CPUs) through the same store, so a worker that fails while starting is reported
at once instead of after a collective timeout. The driver's environment is never modified.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist

from ..errors import DistributedError
from .channel import WorkerLink

__all__ = ["Driver", "RankInfo", "join"]

log = logging.getLogger("tempering")

_KEY = "tempering/control"


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this process sits: its rank, the number of ranks, and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device_type != "cpu":
        raise DistributedError(f"several processes run on 'cuda' GPUs, or on 'cpu' for tests; not on {device_type!r}")
    return torch.device("cpu")


def _init_group(store: dist.Store, info: RankInfo, timeout_s: float) -> None:
    if dist.is_initialized():
        raise DistributedError("torch.distributed is already initialized in this process; a multi-GPU tempering run "
                               "starts its own process group: run it in a process of its own")
    is_cuda = info.device.type == "cuda"
    dist.init_process_group("nccl" if is_cuda else "gloo", store=dist.PrefixStore("tempering/pg", store),
                            rank=info.rank, world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=info.device if is_cuda else None)


class Driver:
    """Rank 0 of a multi-process run: its workers' channels, and what happens when one dies.

    Build it with `Driver.start` (launch the workers) or `Driver.from_env` (under torchrun).

    Attributes:
        info: this process's RankInfo (rank 0).
        links: one WorkerLink per worker, in rank order (ranks 1..N-1).
    """

    def __init__(self, info: RankInfo, links: list[WorkerLink], listener: Listener, store: dist.Store) -> None:
        self.info = info
        self.links = links
        self._listener = listener
        self._store = store  # kept alive: the driver may host it
        self._callbacks: list[Callable[[DistributedError], None]] = []
        self._error: DistributedError | None = None
        self._lock = threading.Lock()
        self._closed = False
        for link in links:
            link._on_failure = self._failed

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def error(self) -> DistributedError | None:
        """The first worker failure, or None."""
        return self._error

    def check(self) -> None:
        """Raise the DistributedError of a dead worker, if one died."""
        if self._error is not None:
            raise self._error

    def on_failure(self, callback: Callable[[DistributedError], None]) -> None:
        """Call `callback(error)` (from a background thread) when a worker dies; at once if one has."""
        with self._lock:
            self._callbacks.append(callback)
            error = self._error
        if error is not None:
            callback(error)

    def _failed(self, error: DistributedError) -> None:
        with self._lock:
            if self._error is not None or self._closed:
                return
            self._error = error
            callbacks = list(self._callbacks)
        log.error("%s", error)
        if self.device.type == "cuda" and dist.is_initialized():
            # NCCL waits for a dead peer until the collective timeout: abort the group, so that a
            # training step blocked in an all-reduce fails now
            try:
                dist.group.WORLD.abort()
            except Exception as exc:
                log.warning("could not abort the NCCL process group: %r", exc)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:
                log.exception("a worker-failure callback failed")

    def close(self, timeout_s: float = 30.0) -> None:
        """Shut the workers down (killing those that do not exit in `timeout_s`) and leave the group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for link in self.links:
            link.request_shutdown()
        # leave the group before waiting for the workers, which leave it on their way out: with
        # NCCL a rank's destroy_process_group may wait for the others' (a two-H200 run had its
        # worker killed after this wait, when rank 0 left only after the workers had exited)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                log.warning("leaving the process group failed: %r", exc)
        for link in self.links:
            link.close(timeout_s)
        self._listener.close()

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def start(cls, num_procs: int, *, device_type: str, command: Sequence[str], timeout_s: float = 600.0,
              start_timeout_s: float = 600.0, host: str = "127.0.0.1") -> Driver:
        """Launch `command` as ranks 1..num_procs-1 and join them as rank 0.

        Args:
            num_procs: processes in all, this one included (one per GPU).
            device_type: "cuda" (rank r on cuda:r, NCCL) or "cpu" (gloo; for tests).
            command: argv of a worker (service/worker.py's `worker_command()`, or a benchmark's own
                script); it must call `join()` with the same device type and timeout, then serve
                its channel.
            timeout_s: how long a collective may wait for another rank.
            start_timeout_s: how long the workers may take to start and connect.
            host: the interface the store and the control listener bind to.

        Raises:
            DistributedError: if a worker exits or does not connect in time; the others are killed.
        """
        if num_procs < 2:
            raise DistributedError(f"a multi-process run needs at least 2 processes, got {num_procs}")
        if device_type == "cuda" and torch.cuda.device_count() < num_procs:
            raise DistributedError(f"{num_procs} GPUs were asked for but {torch.cuda.device_count()} are visible "
                                   "(CUDA_VISIBLE_DEVICES); ask for fewer")
        store = dist.TCPStore(host, 0, world_size=num_procs, is_master=True,
                              timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
        info = RankInfo(0, num_procs, 0, _device(device_type, 0))

        def spawn() -> list[subprocess.Popen]:
            procs = []
            for rank in range(1, num_procs):
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(num_procs), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(num_procs), "MASTER_ADDR": host, "MASTER_PORT": str(store.port)}
                procs.append(subprocess.Popen(list(command), env=env))
            return procs

        return cls._rendezvous(info, store, host, spawn, timeout_s, start_timeout_s)

    @classmethod
    def from_env(cls, *, device_type: str, timeout_s: float = 600.0, start_timeout_s: float = 600.0) -> Driver:
        """Rank 0 of a run that torchrun started (its variables set; the workers started by it)."""
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if rank != 0:
            raise DistributedError(f"the driver must be rank 0, this process is rank {rank}")
        info = RankInfo(0, int(os.environ["WORLD_SIZE"]), local_rank, _device(device_type, local_rank))
        host = os.environ["MASTER_ADDR"]
        store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world_size=info.world_size,
                              is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                              timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
        return cls._rendezvous(info, store, host, list, timeout_s, start_timeout_s)

    @classmethod
    def _rendezvous(cls, info: RankInfo, store: dist.Store, host: str, spawn: Callable[[], list[subprocess.Popen]],
                    timeout_s: float, start_timeout_s: float) -> Driver:
        key = secrets.token_bytes(32)
        listener = Listener((host, 0), authkey=key)
        store.set(_KEY, f"{listener.address[0]}:{listener.address[1]}:{key.hex()}")
        procs = spawn()
        by_rank = dict(enumerate(procs, start=1))
        try:
            conns = _accept(listener, info.world_size - 1, by_rank, start_timeout_s)
            links = [WorkerLink(rank, conns[rank], process=by_rank.get(rank)) for rank in range(1, info.world_size)]
            _init_group(store, info, timeout_s)
        except BaseException:
            listener.close()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            raise
        return cls(info, links, listener, store)


def _accept(listener: Listener, count: int, procs: dict[int, subprocess.Popen], timeout_s: float) -> dict[int, Connection]:
    """The workers' connections by rank, watching their processes while waiting."""
    arrivals: queue.Queue = queue.Queue()

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):
                return  # the listener was closed
            except Exception as exc:  # a wrong key (AuthenticationError): not one of ours
                log.warning("refused a connection to the control listener: %r", exc)
                continue
            arrivals.put(conn)

    threading.Thread(target=accept, name="tempering-accept", daemon=True).start()
    conns: dict[int, Connection] = {}
    deadline = time.monotonic() + timeout_s
    while len(conns) < count:
        try:
            conn = arrivals.get(timeout=0.2)
        except queue.Empty:
            for rank, proc in procs.items():
                if proc.poll() is not None and rank not in conns:
                    raise DistributedError(f"worker rank {rank} exited with code {proc.returncode} while starting; "
                                           "see its output above") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, count + 1)) - set(conns))
                raise DistributedError(f"workers {missing} did not connect within {timeout_s:.0f} s") from None
            continue
        kind, rank, *_ = conn.recv()
        if kind != "hello" or rank in conns:
            conn.close()
            continue
        conns[rank] = conn
    return conns


def join(*, device_type: str, timeout_s: float = 600.0, start_timeout_s: float = 600.0) -> tuple[RankInfo, Connection]:
    """Join the run as a worker (rank > 0), from torchrun's variables: connect to the driver's
    channel, then the process group.

    Args:
        device_type: "cuda" or "cpu", as the driver's.
        timeout_s: how long a collective may wait for another rank (as the driver's).
        start_timeout_s: how long to wait for the driver's rendezvous.

    Returns:
        (this rank's RankInfo, the connection to serve with `channel.serve`).
    """
    env = os.environ
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", rank))
    info = RankInfo(rank, world_size, local_rank, _device(device_type, local_rank))
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=start_timeout_s))
    host, port, key = store.get(_KEY).decode().rsplit(":", 2)
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    conn.send(("hello", rank, os.getpid()))
    _init_group(store, info, timeout_s)
    return info, conn
