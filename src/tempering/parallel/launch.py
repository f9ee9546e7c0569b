"""Starting the processes of a multi-GPU run and joining them in torch.distributed, torchrun-style.

One process per GPU: rank r computes on `cuda:LOCAL_RANK` (or, for tests, on the CPU with gloo).
The driver (rank 0) is the process the user started (`tempering serve --gpus N`,
`LocalBackend(gpus=N)`, a benchmark). `Driver.start` launches ranks 1..N-1 as child processes
with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so a worker starts the same way under `torchrun`, where `Driver.from_env` takes
rank 0's place, on one machine or several (`--nnodes`; GROUP_RANK is a worker's node).

Rendezvous goes through a `torch.distributed.TCPStore` (hosted by the driver, or by torchrun's
agent): the driver publishes the address and key of its control listener there; each worker
connects its channel (channel.py) and says who it is (rank, pid, node, hostname), and only then
does every rank join the process group (NCCL on GPUs, gloo on CPUs) through the same store, so a
worker that fails while starting is reported at once instead of after a collective timeout. In a
run over several machines the listener takes every interface and is published as MASTER_ADDR, the
name the other nodes already reach the store by. The driver's environment is never modified.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist

from ..errors import DistributedError
from .channel import RUN_LOST, WorkerLink, keep_alive
from .handshake import accept_workers

__all__ = ["Driver", "RankInfo", "join"]

log = logging.getLogger("tempering")

# how long the driver waits, after one rank of another node is lost, for that node's other
# ranks, so that its error names all of them
NODE_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this process sits: its rank, the number of ranks, the device it computes on, and its
    machine: `node` is torchrun's GROUP_RANK (0 when the driver started the workers), `host` the
    hostname, `local_world_size` the ranks on this machine."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int
    node: int
    host: str

    @classmethod
    def from_env(cls, device_type: str) -> RankInfo:
        """This process's place from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE, GROUP_RANK); it takes `cuda:LOCAL_RANK` for "cuda"."""
        env = os.environ
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        return cls(rank, world_size, local_rank, _device(device_type, local_rank),
                   int(env.get("LOCAL_WORLD_SIZE", world_size)), int(env.get("GROUP_RANK", 0)), socket.gethostname())

    @property
    def spans_nodes(self) -> bool:
        """Whether the run has ranks on other machines."""
        return self.local_world_size < self.world_size


def _keys() -> tuple[str, str, str]:
    """The store keys of the control listener's address, of the process group and of the
    services' own keys (work_sharing.py), per torchrun restart (`--max-restarts`), so that a
    restarted run never reads the previous one's."""
    prefix = f"tempering/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"{prefix}/control", f"{prefix}/pg", f"{prefix}/services/"


def _device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"local rank {local_rank} computes on cuda:{local_rank}, but this machine shows "
                                   f"{torch.cuda.device_count()} GPUs (CUDA_VISIBLE_DEVICES): start at most that many "
                                   "processes on it (torchrun --nproc-per-node)")
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
    # the ranks of this machine share its cores: with every process at the default (all cores), the
    # parallel CPU kernels of N ranks at once (a checkpoint's slicing, say) spun against each other
    # and took 70 s for what takes 1.5 s (four H200 ranks on 64 cores, loading a 72B adapter's state).
    # A CPU run's driver (a test's own process, whose other work needs its cores) keeps its threads.
    if is_cuda or info.rank > 0:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group("nccl" if is_cuda else "gloo", store=dist.PrefixStore(_keys()[1], store),
                                rank=info.rank, world_size=info.world_size, timeout=timeout,
                                device_id=info.device if is_cuda else None)
    except BaseException:
        # the group's store keys carry its name, a process-wide count that only destroy_process_group
        # resets; a failed init leaves it advanced, and this process's next run would then wait for
        # its fresh workers (count 0) under another name until `timeout_s`
        world = getattr(dist.distributed_c10d, "_world", None)  # private: absent in another torch, left alone
        if not dist.is_initialized() and hasattr(world, "group_count"):
            world.group_count = 0
        raise


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
        self._failing = False
        for link in links:
            link._on_failure = lambda error, link=link: self._failed(link, error)

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def store(self) -> dist.Store:
        """A store of this run's that every rank reaches (under its own key prefix)."""
        return dist.PrefixStore(_keys()[2], self._store)

    @property
    def nodes(self) -> list[int]:
        """The node ranks (torchrun's GROUP_RANK) of the run's machines: [0] on one machine."""
        return sorted({self.info.node, *(link.node for link in self.links if link.node is not None)})

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

    def _failed(self, link: WorkerLink, error: DistributedError) -> None:
        self.fail(error, link=link)

    def fail(self, error: DistributedError, *, link: WorkerLink | None = None) -> None:
        """Stop the run with `error`, as when a worker dies: abort the NCCL group, record the error
        (`check` raises it from now on) and call the `on_failure` callbacks. For rank 0's own
        failures that leave the workers waiting in a collective (a registration that failed here
        alone); `link`: the worker whose connection broke. Only the first failure counts."""
        with self._lock:
            if self._failing or self._closed:
                return
            self._failing = True
        if self.device.type == "cuda" and dist.is_initialized():
            # NCCL waits for a dead peer until the collective timeout: abort the group, so that a
            # training step blocked in an all-reduce fails now
            try:
                dist.group.WORLD.abort()
            except Exception as exc:
                log.warning("could not abort the NCCL process group: %r", exc)
        if link is not None:
            error = self._node_error(link) or error
        with self._lock:
            self._error = error
            callbacks = list(self._callbacks)
        log.error("%s", error)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:
                log.exception("a worker-failure callback failed")

    def _node_error(self, link: WorkerLink) -> DistributedError | None:
        """When `link`'s worker ran on another machine that had other workers: wait briefly for
        theirs to break too, and if they did, one error naming the node and all its lost ranks."""
        if link.node is None or link.node == self.info.node:
            return None
        peers = [other for other in self.links if other.node == link.node]
        deadline = time.monotonic() + NODE_GRACE_S
        while any(other.error is None for other in peers) and time.monotonic() < deadline:
            time.sleep(0.05)
        lost = [other for other in peers if other.error is not None]
        if len(lost) < 2:
            return None
        ranks = ", ".join(f"{other.rank} (pid {other.pid})" for other in lost)
        return DistributedError(
            f"{link.where} left this multi-GPU run: the connections of its worker ranks {ranks} to the driver broke "
            f"(the machine, its torchrun, or the network to it went down). {RUN_LOST} see torchrun's output on "
            f"{link.where}, then start torchrun again on every node: it resumes from the last checkpoint")

    def close(self, timeout_s: float = 30.0) -> None:
        """Shut the workers down (killing those that do not exit in `timeout_s`) and leave the group.
        After a worker failure, the others are told why and exit at once (with code 1)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        reason = str(self._error) if self._error is not None else None
        for link in self.links:
            link.request_shutdown(reason)
        # leave the group before waiting for the workers, which leave it on their way out: with
        # NCCL a rank's destroy_process_group may wait for the others' (a two-H200 run had its
        # worker killed after this wait, when rank 0 left only after the workers had exited)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                log.warning("leaving the process group failed: %r", exc)
        for link in self.links:
            link.close(timeout_s, reason)
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
            DistributedError: if `command` is empty or a string, if a worker cannot be started
                (`command` is no executable), exits, or does not connect in time; the others are killed.
        """
        if num_procs < 2:
            raise DistributedError(f"a multi-process run needs at least 2 processes, got {num_procs}")
        if isinstance(command, str) or not command:
            raise DistributedError(f"a worker's command must be a non-empty argv list (tempering.service.worker."
                                   f"worker_command() gives tempering's), got {command!r}")
        if device_type == "cuda" and torch.cuda.device_count() < num_procs:
            raise DistributedError(f"{num_procs} GPUs were asked for but {torch.cuda.device_count()} are visible "
                                   "(CUDA_VISIBLE_DEVICES); ask for fewer")
        store = dist.TCPStore(host, 0, world_size=num_procs, is_master=True,
                              timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
        info = RankInfo(0, num_procs, 0, _device(device_type, 0), num_procs, 0, socket.gethostname())

        def spawn(rank: int) -> subprocess.Popen:
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(num_procs), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(num_procs), "GROUP_RANK": "0", "MASTER_ADDR": host,
                   "MASTER_PORT": str(store.port)}
            try:
                return subprocess.Popen(list(command), env=env)
            except OSError as exc:
                raise DistributedError(f"could not start worker rank {rank} with the command {list(command)!r}: "
                                       f"{exc}; its first item must be an executable (sys.executable, say)") from exc

        return cls._rendezvous(info, store, host, host, spawn, timeout_s, start_timeout_s)

    @classmethod
    def from_env(cls, *, device_type: str, timeout_s: float = 600.0, start_timeout_s: float = 600.0) -> Driver:
        """Rank 0 of a run that torchrun started (its variables set; the workers started by it),
        on one machine or several (`torchrun --nnodes`).

        Raises:
            DistributedError: if this process is not rank 0, or a worker does not connect in
                `start_timeout_s` (a node that never started, a firewall between the nodes).
        """
        info = RankInfo.from_env(device_type)
        if info.rank != 0:
            raise DistributedError(f"the driver must be rank 0, this process is rank {info.rank}")
        master = os.environ["MASTER_ADDR"]
        store = dist.TCPStore(master, int(os.environ["MASTER_PORT"]), world_size=info.world_size,
                              is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                              timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
        # other machines reach the listener by the name they reach the store by; on one machine,
        # it takes only the loopback interface
        bind, publish = ("0.0.0.0", master) if info.spans_nodes else ("127.0.0.1", "127.0.0.1")
        return cls._rendezvous(info, store, bind, publish, None, timeout_s, start_timeout_s)

    @classmethod
    def _rendezvous(cls, info: RankInfo, store: dist.Store, bind: str, publish: str,
                    spawn: Callable[[int], subprocess.Popen] | None, timeout_s: float,
                    start_timeout_s: float) -> Driver:
        """Publish the control listener, start ranks 1.. with `spawn(rank)` (None: torchrun started
        them), take their hellos, then join the group with them; on any failure, close the listener
        and the links, kill the workers started here, and raise."""
        key = secrets.token_bytes(32)
        listener = Listener((bind, 0), authkey=key)
        procs: dict[int, subprocess.Popen] = {}
        links: list[WorkerLink] = []
        try:
            store.set(_keys()[0], f"{publish}:{listener.address[1]}:{key.hex()}")
            for rank in range(1, info.world_size) if spawn is not None else ():
                procs[rank] = spawn(rank)
            hellos = accept_workers(listener, info.world_size - 1, procs, start_timeout_s)
            links = [WorkerLink(rank, conn, process=procs.get(rank), pid=pid,
                                node=node if info.spans_nodes else None, host=host)
                     for rank, (conn, pid, node, host) in sorted(hellos.items())]
            _init_group(store, info, timeout_s)
        except BaseException as exc:
            # a worker that died after joining the channel (in its init_process_group) left this
            # rank's init waiting for it until `timeout_s`: its error names it, the timeout does not
            error = next((link.error for link in links if link.error is not None), None)
            listener.close()
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            for link in links:  # their threads and connections
                link.close(5.0, reason=str(error or exc))
            if error is not None and isinstance(exc, Exception) and not isinstance(exc, DistributedError):
                raise error from exc
            raise
        return cls(info, links, listener, store)


def join(*, device_type: str, timeout_s: float = 600.0,
         start_timeout_s: float = 600.0) -> tuple[RankInfo, Connection, dist.Store]:
    """Join the run as a worker (rank > 0), from torchrun's variables: connect to the driver's
    channel (on this machine or another), say who this is (rank, pid, node, hostname), then join
    the process group.

    Args:
        device_type: "cuda" (this rank computes on cuda:LOCAL_RANK) or "cpu", as the driver's.
        timeout_s: how long a collective may wait for another rank (as the driver's).
        start_timeout_s: how long to wait for the driver's rendezvous.

    Returns:
        (this rank's RankInfo, the connection to serve with `channel.serve`, a store of the run's
        that every rank reaches, as `Driver.store`).

    Raises:
        DistributedError: if LOCAL_RANK has no GPU here, or the driver's channel cannot be reached.
    """
    info = RankInfo.from_env(device_type)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=info.world_size,
                          is_master=False, timeout=datetime.timedelta(seconds=start_timeout_s))
    host, port, key = store.get(_keys()[0]).decode().rsplit(":", 2)
    try:
        conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    except OSError as exc:
        raise DistributedError(f"rank {info.rank} on {info.host} could not reach the driver's control channel at "
                               f"{host}:{port} ({exc}): the nodes must reach each other on any TCP port") from exc
    keep_alive(conn)
    conn.send(("hello", info.rank, os.getpid(), info.node, info.host))
    _init_group(store, info, timeout_s)
    return info, conn, dist.PrefixStore(_keys()[2], store)
