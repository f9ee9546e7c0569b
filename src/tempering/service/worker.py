"""A worker process of a multi-GPU run (ranks 1..N-1): `worker_command()` starts one.

The driver (rank 0: `tempering serve --gpus N` or `LocalBackend(gpus=N)`) starts one per extra
GPU (or torchrun does, with `--device-type` and `--timeout-s` as the driver's). A worker joins
the run (parallel/launch.py) and serves the driver's channel (parallel/channel.py) with a
`WorkerHub`: for every model the driver registers it loads a ModelService of its own (weights,
engine replica, data-parallel trainer) on its GPU, runs its part of each training call, and
serves the generations the driver's router sends it. It exits when the driver shuts it down or
goes away.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engine import EngineConfig, SamplingParams
from ..engine.grammar import GrammarSpec
from ..engine.cpu_threads import run_in_own_thread
from ..engine.memory import freeze_heap, unfreeze_heap
from ..errors import UnknownModelError
from ..parallel import RankInfo, join, serve, settle
from ..storage import ModelPaths
from ..training.data_parallel import DataParallel
from ..types import LoRAConfig, TrainConfig, TrainSFTConfig
from .service import ModelService, dtype_named

__all__ = ["WorkerHub", "main", "worker_command"]

log = logging.getLogger("tempering")


def worker_command(device_type: str, timeout_s: float) -> list[str]:
    """The argv that starts a worker of a run on `device_type` ("cuda" or "cpu").

    `-c`, not `-m`: importing tempering imports this module, which `-m` would then run a second time.
    """
    return [sys.executable, "-c", "from tempering.service.worker import main; main()",
            "--device-type", device_type, "--timeout-s", str(timeout_s)]


class WorkerHub:
    """The models of one worker rank, driven by rank 0's ModelHub and services.

    Args:
        info: this rank's place in the run (its device).
    """

    def __init__(self, info: RankInfo, store: dist.Store | None = None) -> None:
        self.info = info
        self.dp = DataParallel(store=store)
        self.services: dict[str, ModelService] = {}
        # for requests that may block (see submit)
        self._helpers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tempering-submit")
        self._aborts: dict[concurrent.futures.Future, Callable[[], None]] = {}  # how to stop each running request

    def register(self, *, root: str, project: str, name: str, base_model: str, lora: LoRAConfig | None,
                 engine_config: EngineConfig | None, max_seq_len: int | None, dtype: str | None = None,
                 dedicated: bool = False) -> int:
        """Load this rank's service of a model rank 0 registers (same arguments); its step."""
        if name not in self.services:
            self.services[name] = ModelService(ModelPaths(Path(root), project, name), base_model, lora=lora,
                                               device=self.info.device, engine_config=engine_config,
                                               max_seq_len=max_seq_len, dtype=dtype_named(dtype),
                                               dp=self.dp, dedicated=dedicated, on_run_failure=_exit_run)
            freeze_heap()
        return self.services[name].step

    def sees_file(self, *, path: str, text: str) -> bool:
        """Whether `path` exists here with `text` in it (rank 0's check of a shared storage root)."""
        try:
            return Path(path).read_text() == text
        except OSError:
            return False

    def unregister(self, *, name: str) -> None:
        service = self.services.pop(name, None)
        if service is not None:
            service.close()
            unfreeze_heap()  # its reference cycles collected

    def follow_train(self, *, name: str, sequences: list, config: TrainConfig, new_step: int) -> None:
        run_in_own_thread(self._service(name).follow_train, sequences, config, new_step)

    def follow_train_sft(self, *, name: str, per_trajectory: list, config: TrainSFTConfig, new_step: int) -> None:
        run_in_own_thread(self._service(name).follow_train_sft, per_trajectory, config, new_step)

    def help_train(self, *, name: str, sequences: list, config: TrainConfig, data_step: int, key: str) -> int:
        """Dedicated mode: micro-batches of rank 0's step while this rank's engine is idle
        (ModelService.help_train)."""
        return run_in_own_thread(self._service(name).help_train, sequences, config, data_step, key)

    def receive_adapter(self, *, name: str, lora: LoRAConfig, new_step: int) -> None:
        """Dedicated mode: rank 0's adapter after its training call (ModelService.receive_adapter)."""
        self._service(name).receive_adapter(lora, new_step)

    def submit(self, *, name: str, prompt_ids: list[int], params: SamplingParams, n: int, step: int | None,
               grammar: GrammarSpec | None, on_token: Any = None) -> concurrent.futures.Future:
        """A generation the driver's router sent here; a Future of its completions.

        A request that may block (a grammar to compile, a saved step's adapter to load, which
        waits for a running training step) is queued on a helper thread: the thread that reads
        the driver's messages never waits.
        """
        service = self._service(name)
        if grammar is None and step is None:
            future = service.submit(prompt_ids, params, n=n, step=step, on_token=on_token)
            return self._abortable(future, lambda: service.abort(future))
        outer: concurrent.futures.Future = concurrent.futures.Future()
        lock = threading.Lock()
        state: dict[str, Any] = {"inner": None, "aborted": False}

        def copy_to_outer(f: concurrent.futures.Future) -> None:
            if f.cancelled():  # aborted before the engine admitted it
                outer.cancel()  # serve answers a cancelled request with RequestAborted
            elif f.exception() is not None:
                settle(outer, exception=f.exception())
            else:
                settle(outer, result=f.result())

        def prepare_and_submit() -> None:
            if state["aborted"]:
                return
            try:
                if grammar is not None:
                    params.grammar = service.grammars.compile(grammar)
                inner = service.submit(prompt_ids, params, n=n, step=step, on_token=on_token)
            except Exception as exc:
                settle(outer, exception=exc)
                return
            with lock:
                state["inner"] = inner
                aborted = state["aborted"]
            if aborted:  # the abort came while the request was being prepared
                service.abort(inner)
            inner.add_done_callback(copy_to_outer)

        def abort() -> None:
            with lock:
                state["aborted"] = True
                inner = state["inner"]
            if inner is not None:
                service.abort(inner)  # its RequestAborted reaches `outer` through `copy_to_outer`
            else:
                outer.cancel()  # not submitted yet: serve answers a cancelled request with RequestAborted

        self._helpers.submit(prepare_and_submit)
        return self._abortable(outer, abort)

    def _abortable(self, future: concurrent.futures.Future, abort: Callable[[], None]) -> concurrent.futures.Future:
        self._aborts[future] = abort
        future.add_done_callback(lambda f: self._aborts.pop(f, None))
        return future

    def abort(self, future: concurrent.futures.Future) -> None:
        """Stop a generation from `submit` (the driver's client went away): it fails with
        RequestAborted. Nothing happens to one already done."""
        abort = self._aborts.get(future)
        if abort is not None:
            abort()

    def _service(self, name: str) -> ModelService:
        service = self.services.get(name)
        if service is None:
            raise UnknownModelError(f"worker rank {self.info.rank} has no model {name!r}")
        return service

    def close(self) -> None:
        for name in list(self.services):
            self.unregister(name=name)
        self._helpers.shutdown(wait=False, cancel_futures=True)


def _exit_run(error: Exception) -> None:
    """This rank cannot go on (its tensor-parallel engine failed): exit at once, as when the driver
    goes away. The driver then stops the run with a DistributedError naming this rank; the cause
    is the error logged here."""
    log.error("%s", error)
    logging.shutdown()
    os._exit(1)  # threads may be blocked in collectives with peers that wait for this rank


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tempering-worker", description=__doc__.splitlines()[0])
    parser.add_argument("--device-type", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long a collective waits for another rank")
    args = parser.parse_args(argv)
    # a rank that hangs (a collective no peer joins) shows where: `kill -USR1 PID` prints every thread's stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    info, conn, store = join(device_type=args.device_type, timeout_s=args.timeout_s)
    where = f" node {info.node}" if info.spans_nodes else ""
    logging.basicConfig(level=logging.INFO, format=f"[rank {info.rank}{where}] %(levelname)s %(name)s: %(message)s")
    hub = WorkerHub(info, store)
    if not serve(conn, hub, rank=info.rank):  # serve logged why
        os._exit(1)  # a call may be blocked in a collective with a dead rank: do not wait for it
    hub.close()
    dist.destroy_process_group()
