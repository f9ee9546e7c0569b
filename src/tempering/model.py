"""`Model` and `TrainableModel`: the user's handle on a model (ART's client API)."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator

from .backends.art_mapping import (
    ArtOptionWarning,
    lora_config_from_art,
    resolve_internal_config,
    train_config_from_options,
)
from .backends.base import check_awaited, report_nothing_learned
from .capture import capturing_http_client
from .errors import BackendError, ConfigError, TrajectoryError
from .progress import TrainProgress
from .tracking import WandbReporter, wandb_wanted
from .types import (
    LoRAConfig,
    TrainConfig,
    TrainResult,
    TrainSFTConfig,
    Trajectory,
    TrajectoryGroup,
    summarize_groups,
)

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from .backends.base import Backend

__all__ = ["Model", "TrainableModel"]

log = logging.getLogger("tempering")


class Model(BaseModel):
    """A model reached through an OpenAI-compatible API: a baseline, or (subclass) one being trained.

    Set `inference_base_url`, `inference_api_key` and `inference_model_name` to use any API;
    `register(backend)` gives the model a place to log its metrics (`model.log`).
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    project: str
    entity: str | None = None
    id: str | None = None
    config: Any = None
    trainable: bool = False
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None
    base_path: str | None = None  # ART compatibility; LocalBackend(path=...) decides where files go
    report_metrics: list[str] | None = None

    _backend: Backend | None = PrivateAttr(default=None)
    _openai_client: AsyncOpenAI | None = PrivateAttr(default=None)
    _wandb: WandbReporter | None = PrivateAttr(default=None)

    def _report(self, metrics: dict[str, float], step: int) -> None:
        """Send a history row to W&B when it is wanted (see tracking.py)."""
        if self._wandb is None:
            if not wandb_wanted(self.report_metrics):
                return
            self._wandb = WandbReporter(project=self.project, name=self.name, config=self.model_dump(mode="json"))
        self._wandb.log(metrics, step=step)

    def finish_reporting(self) -> None:
        """Close this model's W&B run, if it has one."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    async def register(self, backend: Backend) -> None:
        """Attach the model to `backend` (where its history and checkpoints are kept).

        `backend.close()` closes the model's `openai_client()`; a later call makes a new one.
        """
        self._backend = backend
        await self._close_openai_client()  # the previous endpoint's client: its pooled connections go
        await backend.register(self)

    async def _backend_closed(self, backend: Backend) -> None:
        """Called by `backend.close()`: close the OpenAI client whose connections go to its server,
        unless the model has been registered with another backend since."""
        if self._backend is backend:
            await self._close_openai_client()

    async def _close_openai_client(self) -> None:
        client, self._openai_client = self._openai_client, None
        if client is None:
            return
        try:
            await client.close()
        except Exception as exc:  # its connections belong to an event loop that has closed: nothing left to close
            log.debug("closing model %r's OpenAI client failed: %s: %s", self.name, type(exc).__name__, exc)

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise BackendError(f"model {self.name!r} is not registered; call `await model.register(backend)` first")
        return self._backend

    def openai_client(self) -> AsyncOpenAI:
        """An `openai.AsyncOpenAI` client for this model's endpoint (cached until the model is
        registered again or its backend is closed, which close it).

        Its chat completions are captured inside `art.capture_auto_trajectory(...)` (and by
        tracing), through the client's HTTP transport; elsewhere it is a plain client.

        Raises:
            BackendError: if the model has no endpoint yet (register it, or set inference_base_url).
        """
        if self._openai_client is None:
            if self.inference_base_url is None:
                raise BackendError(
                    f"model {self.name!r} has no inference endpoint: `await model.register(backend)` first, "
                    "or set inference_base_url"
                )
            from openai import AsyncOpenAI

            self._openai_client = AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "none",
                timeout=1200.0,
                max_retries=2,
                http_client=capturing_http_client(),
                # a trained mixture of experts' choices carry the experts they were routed to, for routing
                # replay in training (a tempering server extension; other servers ignore the header)
                default_headers={"X-Return-Routed-Experts": "true"} if self.trainable else None,
            )
        return self._openai_client

    def get_inference_name(self, step: int | None = None) -> str:
        """The `model` string to send in requests: the latest policy, or `name@step` for a saved step."""
        if self._backend is not None and self.trainable:
            return self._backend._model_inference_name(self, step)
        return self.inference_model_name or self.name

    async def get_step(self) -> int:
        """The latest trained step (0 for a model that is not trained)."""
        return 0

    async def log(
        self,
        trajectories: Iterable[Trajectory | BaseException] | Iterable[TrajectoryGroup] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Log metrics of `trajectories` (and any extra `metrics`) as one history row of `split`.

        Rewards and numeric `trajectory.metrics` are averaged into `<split>/reward`,
        `<split>/<metric>`, ...; the trajectories are stored as JSONL. Exception items (what
        `gather_trajectories(..., max_exceptions=...)` returns for failed rollouts) count in
        `<split>/exception_rate`. Returns the logged metrics.

        Raises:
            TrajectoryError: if a reward is not a finite number.
            ConfigError: if a TrajectoryGroup of awaitables was never awaited (nothing is logged).
            BackendError: if the model is not registered.
            TypeError: for an item that is not a Trajectory, an exception or a TrajectoryGroup.
        """
        backend = self._require_backend()
        groups: list[TrajectoryGroup] = []
        loose: list[Trajectory | BaseException] = []
        for item in trajectories or []:
            if isinstance(item, TrajectoryGroup):
                groups.append(item)
            elif isinstance(item, Trajectory | BaseException):
                loose.append(item)
            else:
                raise TypeError(
                    f"model.log() takes Trajectory, exception or TrajectoryGroup items, got {type(item).__name__}")
        check_awaited(groups)
        if loose:
            groups.append(TrajectoryGroup(loose))
        for g, group in enumerate(groups):
            for i, t in enumerate(group):
                if not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
                    raise TrajectoryError(f"group {g}, trajectory {i} has reward {t.reward!r}; rewards must be finite")
        row = summarize_groups(groups, split=split) if groups else {}
        for key, value in (metrics or {}).items():
            row[key if "/" in key else f"{split}/{key}"] = float(value)
        if step is None:
            step = await self.get_step()
        await backend._log(self, split=split, step=step, metrics=row, groups=groups)
        self._report(row, step)
        return row


class TrainableModel(Model):
    """A model trained with RL: a LoRA adapter on `base_model`, served while it learns.

    Args:
        name: unique name; also the model name requests use (`name@step` for a saved step).
        project: groups the models of one task on disk.
        base_model: "SmolLM2-135M-Instruct" (built in), a local HF model directory, a PEFT adapter
            directory to continue from, or a hub id when a hub is reachable.
        lora_config: the adapter's LoRA hyperparameters (default rank 8, alpha 16, all linear layers);
            ART's `art.dev.LoRAConfig` dict is accepted too.
        _internal_config: ART's `art.dev.InternalModelConfig` (engine_args, init_args, peft_args,
            trainer_args, ...), mapped to tempering's settings when the model is registered (the
            table of ART options in docs/guides/art-compatibility.md lists each option). It may also be assigned after
            construction (`model._internal_config = ...`), as ART's notebooks do.

    Raises:
        UnsupportedOptionError: an ART option tempering cannot honour with the given value.
    """

    trainable: bool = True
    base_model: str
    lora_config: LoRAConfig | None = None

    _internal_config: dict[str, Any] | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        internal_config = data.pop("_internal_config", None)
        super().__init__(**data)
        if internal_config is not None:
            resolve_internal_config(internal_config, warn=False)  # fail at construction, warn at register
        self._internal_config = internal_config

    @field_validator("lora_config", mode="before")
    @classmethod
    def _lora_from_art(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return LoRAConfig(**lora_config_from_art(value))
        return value

    async def register(self, backend: Backend, _openai_client_config: Mapping[str, Any] | None = None) -> None:
        """Attach the model to `backend`, which loads it (or resumes it from its checkpoints) and serves it.

        `_openai_client_config` (ART's `art.dev.OpenAIServerConfig`: `server_args`, `engine_args`,
        `log_file` of ART's vLLM server) is passed on to the backend; tempering's server takes its
        settings from the backend (`LocalBackend(engine_config=...)`, `tempering serve`) and the
        model's `_internal_config`, so each option given here is ignored with an ArtOptionWarning.

        Raises:
            ConfigError: if `_openai_client_config` is not a dict.
        """
        if _openai_client_config is not None and not isinstance(_openai_client_config, Mapping):
            raise ConfigError("_openai_client_config must be a dict (art.dev.OpenAIServerConfig), "
                              f"got {type(_openai_client_config).__name__}")
        ignored: list[str] = []
        for key, value in (_openai_client_config or {}).items():
            if isinstance(value, Mapping):
                ignored += [f"{key}.{name}" for name in value]
            elif value is not None:
                ignored.append(key)
        if ignored:
            warnings.warn(f"_openai_client_config: tempering has no equivalent of {', '.join(ignored)} and ignores "
                          f"{'it' if len(ignored) == 1 else 'them'} (the backend's server settings apply; engine "
                          "options go in LocalBackend(engine_config=...) or _internal_config's engine_args)",
                          ArtOptionWarning, stacklevel=2)
        await super().register(backend)
        base_url, api_key = await backend._prepare_backend_for_training(self, _openai_client_config)
        self.inference_base_url = base_url
        self.inference_api_key = api_key
        self.inference_model_name = backend._model_inference_name(self)

    async def get_step(self) -> int:
        return await self._require_backend()._get_step(self)

    async def train(
        self,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> TrainResult:
        """One RL step on `trajectory_groups`; when it returns, `model.name` serves the new policy.

        `_config` (ART's `art.dev.TrainConfig` dict) may carry ART's backend.train options or
        TrainConfig fields by name; they override `config`.

        Returns:
            the new step, its metrics, and `num_groups_trainable` / `is_adapter_unchanged`:
            when no group has reward spread nothing is learned, which a loop can check.

        Raises:
            TrajectoryError: no groups, a non-finite reward, or a trajectory with no sampled choice.
            ConfigError: an invalid option (UnknownOptionError, UnsupportedOptionError for ART's).
        """
        config = config or TrainConfig()
        if _config:
            config = train_config_from_options(_config, base=config)
        groups = list(trajectory_groups)
        backend = self._require_backend()
        step = await self.get_step()
        with TrainProgress(f"train step {step + 1}") as progress:
            result = await backend._train_model(self, groups, config, on_event=progress.on_event)
        report_nothing_learned(result)
        self._report(result.metrics, step)
        return result

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        _config: dict[str, Any] | None = None,
        verbose: bool = False,
    ) -> TrainResult:
        """Supervised fine-tuning of this model's LoRA adapter on the trajectories' assistant messages.

        The same adapter RL trains: an SFT warm-up followed by RL steps is one run. Saves one
        checkpoint (step + 1) and logs `sft/*` metrics.

        Raises:
            TrajectoryError: no trajectories, or one with no assistant message.
        """
        trajectories = list(trajectories)
        backend = self._require_backend()
        step = await self.get_step()
        with TrainProgress(f"sft step {step + 1}") as progress:
            result = await backend._train_sft(self, trajectories, config or TrainSFTConfig(), on_event=progress.on_event)
        self._report(result.metrics, step)
        return result

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Delete every checkpoint but the latest and the one with the highest `best_checkpoint_metric`.

        Returns the deleted steps.
        """
        backend = self._require_backend()
        history = await backend._read_history(self)
        scored = [(row[best_checkpoint_metric], row["step"]) for row in history
                  if isinstance(row.get(best_checkpoint_metric), int | float) and "step" in row]
        keep = [await self.get_step()]
        if scored:
            keep.append(max(scored)[1])
        return await backend._delete_checkpoint_files(self, keep)
