"""LocalBackend: serve and train in this process (or, with `in_process=False`, in a child process).

Each registered `TrainableModel` gets a `ModelService` (weights, engine, trainer, checkpoints).
An OpenAI-compatible server (FastAPI + uvicorn) runs in a background thread on 127.0.0.1, on a
free port, protected by a generated API key; `model.openai_client()` points at it. Training
steps run in a worker thread, so the user's event loop keeps running.

`LocalBackend(gpus=N)` runs on N GPUs: this process is rank 0 (GPU 0, the server) and starts one
worker process per other GPU through torch.distributed (parallel/launch.py); each GPU holds the
model, an engine replica and a data-parallel trainer. If a worker dies, the server stops and every
later call raises its DistributedError. With `dedicated=True` (or, per model, ART's
`_internal_config` `trainer_gpu_ids=[0]`, `inference_gpu_ids=[1, ...]`) GPU 0 only trains and
the others only serve, receiving the adapter after every step: rollouts never share a GPU with a
training step, which is what a PipelineTrainer needs to overlap the two.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..engine import EngineConfig
from ..engine.memory import freeze_heap
from ..errors import BackendError, ConfigError, DistributedError
from ..parallel import Driver
from ..service.hub import ModelHub
from ..service.worker import worker_command
from ..types import TrainConfig, TrainResult, TrainSFTConfig, TrajectoryGroup
from .art_mapping import (
    ModelOptions,
    apply_train_defaults,
    as_engine_config,
    check_backend_options,
    engine_config_with,
    merge_lora,
    resolve_internal_config,
    train_config_from_options,
)
from .base import ModelClients, ModelRef, TrainableModelRef, check_awaited, report_nothing_learned

if TYPE_CHECKING:
    from ..service.server import ServerThread

__all__ = ["DEFAULT_ROOT", "LocalBackend", "check_local_options", "train_config_from_options"]

DEFAULT_ROOT = Path(".tempering")  # where models are stored when no `path` is given


def check_local_options(*, gpus: int, gpu_cost_per_hour_usd: float | None, enable_expert_replay: bool) -> None:
    """Check the LocalBackend arguments that do not depend on where the server runs.

    Raises:
        ConfigError: if `gpus` < 1, or `gpus` > 1 in a process that torchrun started with others.
        UnknownOptionError: an ART option ART's LocalBackend does not have either (the ones
            tempering ignores give a warning).
    """
    art_options = {"gpu_cost_per_hour_usd": gpu_cost_per_hour_usd} if gpu_cost_per_hour_usd is not None else {}
    if not enable_expert_replay:
        art_options["enable_expert_replay"] = enable_expert_replay
    check_backend_options(art_options)
    if gpus < 1:
        raise ConfigError(f"gpus must be at least 1, got {gpus}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if gpus > 1 and world_size > 1:
        raise ConfigError(
            f"LocalBackend(gpus={gpus}) starts its own processes on this machine, but this process is one of "
            f"{world_size} that torchrun started. Run the training script without torchrun; for several machines, "
            "start `tempering serve` under torchrun on every node and drive it with RemoteBackend (see the "
            "Several GPUs guide)")


class LocalBackend:
    """Inference and training in this process (CPU or one GPU), or in one process per GPU.

    Args:
        path: storage root (default `./.tempering`); models live in `<path>/<project>/models/<name>`.
        device: "cpu", "cuda", ...; default CUDA when available.
        gpus: GPUs to run on (one process each, this one on GPU 0); with `device="cpu"`, that
            many CPU processes joined through gloo (for tests of the multi-GPU path).
        host, port: where the OpenAI-compatible server listens (default 127.0.0.1 and a free port).
        api_key: the server's key (default: a random one per backend).
        max_batch_size: most sequences the engine decodes together.
        engine_config: the engine's batching and KV-cache settings (overrides max_batch_size): a
            `tempering.engine.EngineConfig` or a dict of its fields;
            a model's `_internal_config` engine_args override it for that model.
        in_process: False runs the server (engine and trainer) in a child process, which this
            process drives over HTTP as a RemoteBackend (backends/child.py; the call returns that
            backend), as ART's LocalBackend does by default: the engine and the trainer get a
            process of their own. Not faster on the workloads measured (benchmarks/RESULTS.md).
        gpu_cost_per_hour_usd, enable_expert_replay: ART's options, accepted for compatibility
            (see the table of ART options in docs/guides/art-compatibility.md#art-options).
        dedicated: with `gpus` > 1, GPU 0 trains and the others serve, for every trainable model
            (a model's `_internal_config` trainer/inference GPU ids choose it per model).

    Raises:
        TypeError: an option neither this nor ART's LocalBackend has (Python's unexpected-keyword
            error).
        DistributedError: with `gpus` > 1, if a worker process fails to start.
        ConfigError: `dedicated` with one GPU.
    """

    def __new__(cls, *args: Any, in_process: bool = True, **kwargs: Any) -> Any:
        if in_process or cls is not LocalBackend:
            return super().__new__(cls)
        from .child import ChildProcessBackend  # the server in a child process (see its module)

        return ChildProcessBackend(*args, **kwargs)

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
        in_process: bool = True,
        gpu_cost_per_hour_usd: float | None = None,
        enable_expert_replay: bool = True,
        dedicated: bool = False,
    ) -> None:
        check_local_options(gpus=gpus, gpu_cost_per_hour_usd=gpu_cost_per_hour_usd,
                            enable_expert_replay=enable_expert_replay)
        self._model_options: dict[str, ModelOptions] = {}
        self.path = Path(path) if path is not None else DEFAULT_ROOT
        self._failure: DistributedError | None = None
        self._driver = None
        if gpus > 1:
            device_type = "cpu" if device is not None and device.startswith("cpu") else "cuda"
            self._driver = Driver.start(gpus, device_type=device_type, command=worker_command(device_type, 600.0))
        try:
            self.hub = ModelHub(self.path, device=device, driver=self._driver, dedicated=dedicated,
                                engine_config=as_engine_config(engine_config, max_batch_size))
        except BaseException:
            if self._driver is not None:
                self._driver.close()
            raise
        self._host, self._port = host, port
        from ..service.auth import generate_api_key  # with the HTTP stack, which only a serving process needs

        self._api_key = api_key or generate_api_key()
        self._server: ServerThread | None = None
        self._closed = False
        self._clients = ModelClients()
        if self._driver is not None:
            self._driver.on_failure(self._worker_died)

    @property
    def _registry(self):
        return self.hub.registry

    # ---- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close_sync()

    async def close(self) -> None:
        """Close the models' OpenAI clients, stop the server and free every model. The backend
        cannot be used afterwards. (Leaving a `with` block closes all but the clients, which only
        an event loop can close.)"""
        if not self._closed:
            await self._clients.close_all(self)  # first: their connections go to the server stopped next
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.stop()
        self.hub.close()
        if self._driver is not None:
            self._driver.close()

    def _start_workers(self, gpus: int) -> None:
        """Become rank 0 of a run on `gpus` processes, as `LocalBackend(gpus=gpus)` would have
        (for a model whose ART placement asks for dedicated mode). Models already registered
        stay where they are.

        Raises:
            ConfigError: on CUDA, if this machine has fewer GPUs.
            DistributedError: if a worker process fails to start.
        """
        device = self.hub.device or ("cuda" if torch.cuda.is_available() else "cpu")
        device_type = "cpu" if device.startswith("cpu") else "cuda"
        if device_type == "cuda" and torch.cuda.device_count() < gpus:
            raise ConfigError(f"dedicated mode on {gpus} GPUs (trainer_gpu_ids, inference_gpu_ids) but this machine "
                              f"has {torch.cuda.device_count()}")
        self._driver = Driver.start(gpus, device_type=device_type, command=worker_command(device_type, 600.0))
        self.hub.attach_driver(self._driver)
        self._driver.on_failure(self._worker_died)

    def _worker_died(self, error: DistributedError) -> None:
        """A worker process died: stop serving; every later call raises `error`."""
        self._failure = error
        if self._server is not None:  # at once: nothing it could answer now would be right
            self._server.stop(grace_s=1.0)

    def _check_open(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise BackendError("this LocalBackend is closed; create a new one")

    # ---- registration -------------------------------------------------------------------------

    async def register(self, model: ModelRef) -> None:
        """Start serving `model` (loading its weights, resuming from its latest checkpoint).

        Raises:
            ConfigError: if another model of the same name is already registered.
            UnknownModelError: if a TrainableModel's `base_model` cannot be found.
        """
        self._check_open()
        trainable = getattr(model, "trainable", False)
        options = resolve_internal_config(getattr(model, "_internal_config", None))
        lora = merge_lora(getattr(model, "lora_config", None), options)
        if trainable and options.dedicated:
            if self._driver is None:  # ART's way: a plain LocalBackend(), the placement on the model
                await asyncio.to_thread(self._start_workers, options.num_gpus)
            self.hub.check_dedicated_gpus(options.num_gpus, model.name)
        self._model_options[model.name] = options
        await asyncio.to_thread(
            self.hub.register,
            name=model.name,
            project=model.project,
            model_json=model.model_dump(mode="json"),
            base_model=model.base_model if trainable else None,
            lora=lora,
            engine_config=engine_config_with(self.hub.engine_config, options.engine),
            max_seq_len=options.max_seq_len,
            dtype=options.dtype,
            dedicated=True if options.dedicated else None,
        )
        self._clients.add(model)
        if trainable:
            await asyncio.to_thread(self._ensure_server)

    def _ensure_server(self) -> None:
        if self._server is None:
            # the HTTP stack (FastAPI, uvicorn) loads here: worker processes never serve
            from ..service import create_app
            from ..service.server import ServerThread

            server = ServerThread(create_app(self._registry, api_key=self._api_key), host=self._host, port=self._port)
            server.start()
            self._server = server
            freeze_heap()  # the HTTP stack's objects too, as the model's were (engine/memory.py)

    async def _prepare_backend_for_training(self, model: TrainableModelRef, config: Any = None) -> tuple[str, str]:
        self._check_open()
        self.hub.service(model.name)
        assert self._server is not None
        return f"{self._server.base_url}/v1", self._api_key

    def _model_inference_name(self, model: ModelRef, step: int | None = None) -> str:
        return model.name if step is None else f"{model.name}@{step}"

    @property
    def base_url(self) -> str | None:
        """The server's OpenAI base URL (None before a trainable model is registered)."""
        return f"{self._server.base_url}/v1" if self._server else None

    async def _get_step(self, model: TrainableModelRef) -> int:
        return self.hub.step(model.project, model.name)

    # ---- training -----------------------------------------------------------------------------

    async def train(self, model: TrainableModelRef, trajectory_groups: list[TrajectoryGroup], **options: Any) -> TrainResult:
        """One RL step, ART >= 0.5.18 style: `await backend.train(model, groups, learning_rate=1e-5)`.

        Options are TrainConfig's fields plus ART's names: `normalize_advantages`/`scale_rewards`,
        `loss_fn` ("ppo", "cispo", "gspo"), `epsilon`, `epsilon_high`, `kl_penalty_coef`,
        `truncated_importance_sampling`, `importance_sampling_level` ("sequence" is GSPO),
        `mask_prob_ratio`, `logprob_calculation_chunk_size`, `save_checkpoint`. ART options
        tempering does not implement are accepted at their default value (docs/guides/art-compatibility.md,
        "ART options").

        As ART's, it does not log the step: history.jsonl gets its row and trajectories/train its
        groups when the caller logs them, `await model.log(groups, metrics=result.metrics,
        step=result.step, split="train")` (`model.train` logs the step itself).

        Raises:
            UnknownOptionError: an option neither TrainConfig nor ART's backend.train has.
            UnsupportedOptionError: an ART option at a value tempering cannot honour.
        """
        result = await self._train_model(model, trajectory_groups, train_config_from_options(options), log_step=False)
        report_nothing_learned(result)
        return result

    async def _train_model(self, model: TrainableModelRef, trajectory_groups: list[TrajectoryGroup], config: TrainConfig,
                           on_event=None, log_step: bool = True) -> TrainResult:
        """The step of `model.train` (which logs it: `log_step`) and of `train` (which, as ART's, does not)."""
        self._check_open()
        config = apply_train_defaults(config, self._model_options.get(model.name, ModelOptions()).train)
        groups = list(trajectory_groups)
        check_awaited(groups)
        return await self._on_train_thread(self.hub.train, model.name, groups, config, on_event, log_step)

    async def _train_sft(self, model: TrainableModelRef, trajectories: list, config: TrainSFTConfig, on_event=None) -> TrainResult:
        self._check_open()
        return await self._on_train_thread(self.hub.train_sft, model.name, list(trajectories), config, on_event)

    async def _on_train_thread(self, fn, *args) -> TrainResult:
        """`fn(*args)` on the hub's training thread (one call at a time).

        Raises:
            BackendError: if the backend was closed while the call waited for the thread (its
                queued call is dropped, not run).
        """
        future = self.hub.submit_training(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled() and self._closed:  # dropped by close(), not the caller's own cancellation
                raise BackendError("the backend was closed before this training call ran; nothing was trained") from None
            raise

    # ---- logs and checkpoints -----------------------------------------------------------------

    # file I/O, and a deletion waits for a running training step: each in a thread, so that the
    # caller's event loop (its rollouts) goes on meanwhile

    async def _log(self, model: ModelRef, *, split: str, step: int, metrics: dict[str, float], groups: list[TrajectoryGroup]) -> None:
        await asyncio.to_thread(self.hub.log, model.project, model.name, split=split, step=step, metrics=metrics,
                                groups=groups)

    async def _read_history(self, model: ModelRef) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.hub.history, model.project, model.name)

    async def _delete_checkpoint_files(self, model: TrainableModelRef, steps_to_keep: list[int]) -> list[int]:
        return await asyncio.to_thread(self.hub.delete_checkpoints, model.project, model.name, list(steps_to_keep))

    async def list_checkpoints(self, model: ModelRef) -> list[dict[str, Any]]:
        """Saved steps of `model` with the metrics logged for them."""
        return await asyncio.to_thread(self.hub.checkpoints, model.project, model.name)

    async def fork_checkpoint(self, model: ModelRef, *, from_project: str, from_model: str, step: int | None = None,
                              not_after_step: int | None = None) -> int:
        """Copy a checkpoint of another model into `model` (before registering it); returns the step.

        `step` None: the latest one, at or before `not_after_step` if given."""
        return await asyncio.to_thread(self.hub.fork, project=model.project, name=model.name, from_project=from_project,
                                       from_name=from_model, step=step, not_after_step=not_after_step)

    async def _experimental_fork_checkpoint(self, model: ModelRef, from_model: str, from_project: str | None = None,
                                            not_after_step: int | None = None, verbose: bool = False) -> int:
        """ART's name: fork the latest checkpoint of `from_model` (at or before `not_after_step`)."""
        return await self.fork_checkpoint(model, from_project=from_project or model.project, from_model=from_model,
                                          not_after_step=not_after_step)


# inspect.signature (so help(), IDEs and the API reference) reads a class's own `__new__` before its
# `__init__`; `__new__` only picks in_process or a child process, so it shows `__init__`'s parameters
LocalBackend.__new__.__signature__ = inspect.signature(LocalBackend.__init__)
