"""ModelHub: every model of one storage root, what LocalBackend and `tempering serve` both run.

It registers models (loading a ModelService for trainable ones), trains them, logs metrics and
trajectories, lists, deletes and forks checkpoints. All paths come from validated names under
`root`, so nothing a caller sends can reach outside it.

In a multi-GPU run the hub lives on rank 0 (the driver) and registers each trainable model on
every worker rank too (service/worker.py), which load their own copy beside this one. Every rank
reads the checkpoints under `root` (the latest step at registration, a saved step on request), so
over several machines `root` must be one shared directory; the hub checks that it is.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from ..engine import EngineConfig
from ..engine.cpu_threads import run_in_own_thread
from ..engine.memory import freeze_heap, release_free_memory, unfreeze_heap
from ..errors import ConfigError, DistributedError, UnknownModelError
from ..parallel import Driver
from ..storage import (
    ModelPaths,
    append_history,
    delete_checkpoints,
    latest_step,
    list_checkpoints,
    mark_resume,
    read_history,
    verify_checkpoint,
    write_atomically,
    write_trajectories,
)
from ..training.data_parallel import DataParallel
from ..types import LoRAConfig, TrainConfig, TrainResult, TrajectoryGroup
from .registry import ServiceRegistry
from .service import ModelService, dtype_named

__all__ = ["ModelHub"]


# After a rank's registration failed, how long the others get to finish theirs before the run is
# stopped (ModelHub._load): long enough for a shared cause to fail them too, as it does in seconds
PEER_GRACE_S = 30.0


class ModelHub:
    """The models under `root`.

    Args:
        root: storage root (`<root>/<project>/models/<name>/`).
        device: where trainable models run (default CUDA when available, else CPU).
        engine_config: the engines' batching and KV-cache settings.
        driver: in a multi-GPU run, rank 0's Driver (the workers); the models then run on every
            rank, and `device` is the driver's.
        dedicated: in a multi-GPU run, the default placement of trainable models: rank 0 trains,
            the other ranks serve (ModelService); False: every rank does both.
        dtype: the models' dtype by name ("bfloat16", "float16", "float32"; None: bfloat16 on a
            GPU, float32 on a CPU), unless a model's registration names its own.

    Raises:
        ConfigError: for a device this machine does not have, a `dtype` other than those three,
            `dedicated` on one GPU, or, in a
            run over several machines, a `root` that the other nodes do not see.
    """

    def __init__(self, root: Path, *, device: str | None = None, engine_config: EngineConfig | None = None,
                 driver: Driver | None = None, dedicated: bool = False, dtype: str | None = None) -> None:
        if device is not None and driver is None:
            _check_device(device)
        self.root = Path(root)
        self.driver = driver
        self.dp = DataParallel(store=driver.store) if driver is not None else None
        self.device = str(driver.device) if driver is not None else device
        self.engine_config = engine_config or EngineConfig()
        world = driver.info.world_size if driver is not None else 1
        tp = self.engine_config.tensor_parallel_size
        if world % tp:  # refused here, at startup, not when a model is registered
            raise ConfigError(f"tensor_parallel_size {tp} splits each model over {tp} GPUs (processes), but this run "
                              f"has {world}: start it with a multiple of {tp} (--gpus {tp}, LocalBackend(gpus={tp}))")
        dtype_named(dtype)  # a name it does not know fails here, at startup
        self.dtype = dtype  # every model's unless its registration names one
        if dedicated:
            self._check_dedicated()
        self.dedicated = dedicated
        self.registry = ServiceRegistry()
        # training calls run one at a time, queued on this thread (`submit_training`)
        self.train_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tempering-train")
        self._projects: dict[str, str] = {}  # model name -> project (names are global: requests use them)
        self._lock = threading.Lock()
        # one model loads at a time: a second registration of a name waits and finds it loaded (two
        # would each load a copy), and transformers' lazy imports are not thread-safe
        self._load_lock = threading.Lock()
        if driver is not None and len(driver.nodes) > 1:
            self._check_shared_root()

    def submit_training(self, fn, /, *args) -> concurrent.futures.Future:
        """`fn(*args)` queued on the training thread (one call at a time); on CPU it runs in a
        thread of its own (engine/cpu_threads.py), so its OpenMP pool ends with the call."""
        return self.train_executor.submit(run_in_own_thread, fn, *args)

    def _check_shared_root(self) -> None:
        """Raises ConfigError unless every node of the run sees the files rank 0 writes under root."""
        self.root.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        probe = (self.root / f".shared-check-{token}").resolve()
        probe.write_text(token)
        try:
            remote = [link for link in self.driver.links if link.node != self.driver.info.node]
            seen = [link.call("sees_file", path=str(probe), text=token) for link in remote]
            blind = sorted({link.where for link, sees in zip(remote, seen) if not sees.result(60)})
        finally:
            probe.unlink()
        if blind:
            raise ConfigError(
                f"the storage root {probe.parent} is not shared with {', '.join(blind)}: every rank reads the "
                "checkpoints under it (the latest step when a model is registered, a saved step on request). Put it "
                "on a filesystem that every node mounts at the same path (NFS, Lustre, a cloud file share) and pass "
                "that path as --root on every node")

    def paths(self, project: str, name: str) -> ModelPaths:
        return ModelPaths(self.root, project, name)

    def register(self, *, name: str, project: str, model_json: dict[str, Any], base_model: str | None = None,
                 lora: LoRAConfig | None = None, engine_config: EngineConfig | None = None,
                 max_seq_len: int | None = None, dtype: str | None = None, dedicated: bool | None = None) -> int:
        """Record the model and, when `base_model` is given (a trainable model), load its service.

        `engine_config` (default: the hub's), `max_seq_len` (default: the model's context
        length), `dtype` (a torch dtype's name; default: the device's) and `dedicated` (default:
        the hub's) apply to this model only, when its service is created.

        Returns:
            the model's latest step.

        Raises:
            ConfigError: if the name is taken by a model of another project, or invalid.
            UnknownModelError: if the base model cannot be found.
        """
        dedicated = self.dedicated if dedicated is None else dedicated  # ModelService refuses it without workers
        dtype = dtype or self.dtype
        paths = self.paths(project, name)
        with self._lock:
            other = self._projects.get(name)
            if other is not None and other != project:
                raise ConfigError(f"a model named {name!r} is already registered in project {other!r}; use another name")
            is_new_name = other is None
            self._projects[name] = project
        created = [d for d in (paths.model_dir.parent.parent, paths.model_dir.parent, paths.model_dir) if not d.exists()]
        try:
            paths.model_dir.mkdir(parents=True, exist_ok=True)
            service = self.registry.get(name)
            if base_model is not None and service is None:
                with self._load_lock:
                    service = self.registry.get(name)  # loaded meanwhile by a concurrent registration
                    if service is None:  # loads the weights: fails for an unknown base model
                        self._check_same_base(paths, name, base_model, None)
                        service = self._load(paths, base_model, lora=lora,
                                             engine_config=engine_config or self.engine_config,
                                             max_seq_len=max_seq_len, dtype=dtype, dedicated=dedicated)
                        _write_json_atomically(paths.model_json, model_json)
                        mark_resume(paths.history, service.step)  # steps logged after the last checkpoint
                        self.registry.add(name, service)
                        freeze_heap()  # the loaded model's and its modules' objects: out of every later collection
                        return service.step
            if base_model is not None:
                self._check_same_base(paths, name, base_model, service)
            _write_json_atomically(paths.model_json, model_json)
        except BaseException:
            # leave nothing behind: no model.json (nor directories) for a model that does not exist
            if created:
                shutil.rmtree(created[0], ignore_errors=True)
            if is_new_name:
                with self._lock:
                    self._projects.pop(name, None)
            raise
        return service.step if service is not None else 0

    @staticmethod
    def _check_same_base(paths: ModelPaths, name: str, base_model: str, service: ModelService | None) -> None:
        """Refuse a registration whose base model differs from the one the name serves, or trained on.

        Raises:
            ConfigError: naming both base models.
        """
        if service is not None:
            previous = service.base_model
        elif latest_step(paths.checkpoints_dir) > 0 and paths.model_json.is_file():
            previous = json.loads(paths.model_json.read_text()).get("base_model")
        else:
            return  # nothing trained yet: any base model
        if previous is not None and previous != base_model:
            raise ConfigError(f"{name!r} is registered with base model {previous!r}, not {base_model!r}: its adapter "
                              f"fits that base only. Register it with base_model={previous!r}, or use a new model name")

    def _load(self, paths: ModelPaths, base_model: str, **options: Any) -> ModelService:
        """The model's service here, and (multi-GPU) on every worker, loading at the same time.

        In a multi-GPU run this rank's service loads on a thread of its own, so that a worker's
        failure is seen while this rank still loads (waiting, say, for that worker in a
        tensor-parallel engine's first all-reduce).

        Raises:
            DistributedError: when one rank's load failed and, PEER_GRACE_S later, other ranks
                (this one included) are still loading: they wait in a collective for the failed
                rank, so the run is stopped (`Driver.fail`) instead of hanging. Its cause is the
                failed rank's error.
        """
        links = self.driver.links if self.driver is not None else []
        dtype_name = options.pop("dtype", None)  # every rank gets the name
        dtype = dtype_named(dtype_name)

        def load() -> ModelService:
            return ModelService(paths, base_model, device=self.device, dp=self.dp, workers=links, dtype=dtype,
                                on_run_failure=self.driver.fail if self.driver is not None else None, **options)

        if not links:
            return run_in_own_thread(load)  # on CPU its OpenMP pool ends with it (engine/cpu_threads.py)
        futures = {link.rank: link.call("register", root=str(self.root.resolve()), project=paths.project,
                                        name=paths.name, base_model=base_model, dtype=dtype_name, **options)
                   for link in links}
        own: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            own.set_running_or_notify_cancel()
            try:
                own.set_result(load())
            except BaseException as exc:
                own.set_exception(exc)

        # a daemon thread: a load stranded in a collective must not keep the process from exiting
        threading.Thread(target=run, name="tempering-load", daemon=True).start()
        futures = {0: own, **futures}
        try:
            self._wait_for_peers(futures, paths.name)
        finally:
            errors = [(rank, f.exception()) for rank, f in futures.items() if f.done() and f.exception() is not None]
            if errors or not own.done():  # leave no half-registered model on any rank
                for link in links:
                    link.call("unregister", name=paths.name)
                # this rank's service, now or whenever its stranded load ends
                own.add_done_callback(lambda f: f.exception() is None and f.result().close())
        if errors:
            raise errors[0][1]  # this rank's own error first, then the lowest rank's
        return own.result()

    def _wait_for_peers(self, futures: dict[int, concurrent.futures.Future], name: str) -> None:
        """Wait for every rank's registration of `name` (a future per rank, this one's included).

        Once any rank has failed, the others get PEER_GRACE_S to finish (they fail alike when the
        cause is shared, as a missing model); any still loading then waits for the failed rank in
        a collective: the run is stopped with a DistributedError (see `_load`)."""
        concurrent.futures.wait(futures.values(), return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = next(((rank, f.exception()) for rank, f in futures.items()
                       if f.done() and f.exception() is not None), None)
        if failed is None:  # every registration ended, and none failed
            return
        concurrent.futures.wait(futures.values(), timeout=PEER_GRACE_S)
        stuck = [rank for rank, f in futures.items() if not f.done()]
        if not stuck:
            return
        rank, cause = failed
        error = DistributedError(
            f"registering {name!r} failed on rank {rank} ({type(cause).__name__}: {cause}) while rank(s) "
            f"{', '.join(map(str, stuck))} went on loading it; they wait for rank {rank} in a collective, so this "
            f"multi-GPU run cannot go on. Fix the cause, then start the backend again (`tempering serve`, or a "
            f"new LocalBackend after closing this one)")
        self.driver.fail(error)
        raise error from cause

    def attach_driver(self, driver: Driver) -> None:
        """Become rank 0 of `driver`'s run: trainable models registered from now on load on every
        rank (the ones already registered stay on this process alone)."""
        with self._lock:
            self.driver = driver
            self.dp = DataParallel(store=driver.store)
            self.device = str(driver.device)

    @property
    def num_gpus(self) -> int:
        """The processes (GPUs) of this run: 1, or the multi-GPU run's world size."""
        return 1 + (len(self.driver.links) if self.driver is not None else 0)

    def check_dedicated_gpus(self, num_gpus: int, name: str) -> None:
        """Raises ConfigError unless model `name`'s dedicated placement (on `num_gpus`) is this run's."""
        if num_gpus != self.num_gpus:
            raise ConfigError(
                f"model {name!r} asks for dedicated mode on {num_gpus} GPUs (trainer_gpu_ids, inference_gpu_ids) "
                f"but this backend runs on {self.num_gpus}; start it on {num_gpus}: LocalBackend(gpus={num_gpus}) "
                f"or `tempering serve --gpus {num_gpus}`")

    def _check_dedicated(self) -> None:
        """Raises ConfigError unless this is a multi-GPU run (dedicated mode needs GPUs to split)."""
        if self.driver is None:
            raise ConfigError(
                "dedicated mode (ART's trainer_gpu_ids=[0] and inference_gpu_ids=[1, ...]) trains on GPU 0 and "
                "serves from the others: start the backend on them, LocalBackend(gpus=N) or "
                "`tempering serve --gpus N --dedicated`, N >= 2")

    def service(self, name: str) -> ModelService:
        service = self.registry.get(name)
        if service is None:
            raise UnknownModelError(f"no trainable model named {name!r} is registered; register it first")
        return service

    def project_of(self, name: str) -> str:
        project = self._projects.get(name)
        if project is None:
            raise UnknownModelError(f"no model named {name!r} is registered; register it first")
        return project

    def step(self, project: str, name: str) -> int:
        service = self.registry.get(name)
        return service.step if service is not None else latest_step(self.paths(project, name).checkpoints_dir)

    def train(self, name: str, groups: list[TrajectoryGroup], config: TrainConfig, on_event=None,
              log_step: bool = True) -> TrainResult:
        return self.service(name).train(groups, config, on_event=on_event, log_step=log_step)

    def train_sft(self, name: str, trajectories: list, config, on_event=None) -> TrainResult:
        return self.service(name).train_sft(trajectories, config, on_event=on_event)

    def log(self, project: str, name: str, *, split: str, step: int, metrics: dict[str, float], groups: list[TrajectoryGroup]) -> None:
        paths = self.paths(project, name)
        append_history(paths.history, {"step": step, **metrics})
        if groups:
            write_trajectories(paths.trajectories(split, step), groups)

    def history(self, project: str, name: str) -> list[dict[str, Any]]:
        return read_history(self.paths(project, name).history)

    def checkpoints(self, project: str, name: str) -> list[dict[str, Any]]:
        """Saved steps with the metrics history.jsonl holds for them."""
        by_step: dict[int, dict[str, Any]] = {}
        for row in self.history(project, name):
            if "step" in row:
                by_step.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k not in ("step", "recorded_at")})
        return [{"step": c.step, "path": str(c.path), "metrics": by_step.get(c.step, {})}
                for c in list_checkpoints(self.paths(project, name).checkpoints_dir)]

    def delete_checkpoints(self, project: str, name: str, keep_steps: list[int]) -> list[int]:
        """Delete every checkpoint but `keep_steps`, the live policy's step and the highest saved
        one (also when the last step was trained with save_checkpoint=False). A registered model's
        running training step finishes first (its new checkpoint is then the latest)."""
        service = self.registry.get(name)
        with service.train_lock if service is not None else contextlib.nullcontext():
            keep = set(keep_steps) | {self.step(project, name)}
            return delete_checkpoints(self.paths(project, name).checkpoints_dir, keep)

    def fork(self, *, project: str, name: str, from_project: str, from_name: str, step: int | None = None,
             not_after_step: int | None = None) -> int:
        """Copy checkpoint `step` (default: the latest, at or before `not_after_step` if given) of
        another model into this one, at the same step.

        The target must not be registered yet (register it afterwards to serve the fork).

        Raises:
            UnknownModelError: if the source has no such checkpoint.
            CheckpointError: if a file of that checkpoint is damaged (named in the message).
            ConfigError: if the target is already registered, already has that step, or has later
                checkpoints (registering it would resume at those).
        """
        if self.registry.get(name) is not None:
            raise ConfigError(f"{name!r} is registered and serving; fork into a new model name, then register it")
        source = self.paths(from_project, from_name)
        saved = {c.step: c.path for c in list_checkpoints(source.checkpoints_dir)}
        if not saved:
            raise UnknownModelError(f"{from_project}/{from_name} has no checkpoints to fork")
        if step is None:
            candidates = [s for s in saved if not_after_step is None or s <= not_after_step]
            if not candidates:
                raise UnknownModelError(f"{from_project}/{from_name} has no checkpoint at or before step {not_after_step}; "
                                        f"saved: {sorted(saved)}")
            step = max(candidates)
        if step not in saved:
            raise UnknownModelError(f"{from_project}/{from_name} has no checkpoint of step {step}; saved: {sorted(saved)}")
        verify_checkpoint(saved[step])  # a damaged file is named, never copied under a new manifest
        target = self.paths(project, name)
        if (target.checkpoint(step) / "adapter_config.json").exists():
            raise ConfigError(f"{project}/{name} already has a checkpoint of step {step}")
        later = [c.step for c in list_checkpoints(target.checkpoints_dir) if c.step > step]
        if later:  # registering would resume at the latest of them, not at the fork
            raise ConfigError(f"{project}/{name} already has checkpoints after step {step} ({later}): registered, it "
                              f"would resume at step {max(later)}, not at the fork; fork into a new model name, or "
                              f"delete those checkpoints first")
        write_atomically(target.checkpoint(step), lambda tmp: shutil.copytree(saved[step], tmp, dirs_exist_ok=True))
        return step

    def close(self) -> None:
        """Close every model and let its memory go.

        The registry is emptied, not just closed: FastAPI caches facts about endpoint functions
        in module-level `lru_cache`s that outlive the app, and our endpoints close over the
        registry, so a registry still holding services would keep every model of a closed
        backend in memory (about 2 GB per default-model backend, measured).
        """
        for service in self.registry.clear():
            service.close()
        self.train_executor.shutdown(wait=False, cancel_futures=True)
        unfreeze_heap()  # the services' reference cycles (engine callbacks) collected, then the heap back to the OS
        release_free_memory()
        if torch.cuda.is_initialized():  # and the freed GPU blocks to the driver, for other processes
            torch.cuda.empty_cache()


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to a temporary file beside `path`, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _check_device(device: str) -> None:
    """Refuse a device this machine cannot run on, before any model is registered.

    Raises:
        ConfigError: for a string torch does not parse as a device, or CUDA where none is available.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a device: {exc}; use 'cpu' or 'cuda' (or 'cuda:N')") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: CUDA is not available on this machine; use 'cpu'")
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: tempering runs on 'cpu' or 'cuda', not {parsed.type!r}")
