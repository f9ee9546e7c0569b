"""The Backend protocol: what a model needs from wherever inference and training run."""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError
from ..types import TrainConfig, TrainResult, TrajectoryGroup

__all__ = ["Backend", "ModelClients", "ModelRef", "TrainableModelRef", "check_awaited", "report_nothing_learned"]

log = logging.getLogger("tempering")


def check_awaited(groups: list[TrajectoryGroup]) -> None:
    """Refuse groups built from awaitables that were never awaited (they hold no trajectory yet).

    Raises:
        ConfigError: naming the fix, gather_trajectory_groups.
    """
    if any(getattr(g, "is_pending", False) for g in groups):
        raise ConfigError("some trajectory groups were never awaited; pass them through gather_trajectory_groups first")


def report_nothing_learned(result: TrainResult) -> None:
    """Log (once, as a warning) that an RL step had no group with reward spread.

    Called by the public train entry points (`model.train`, `backend.train`) after their
    progress bar is closed, so the line stands on its own.
    """
    if result.is_adapter_unchanged:
        log.warning("training step %d (rollouts of step %d): none of the %d groups has reward spread (every reward "
                    "in a group is equal) and a token to train on (not every sampled token forced by a grammar, with "
                    "exclude_forced_tokens), so there is nothing to learn from; the adapter is unchanged "
                    "(TrainResult.is_adapter_unchanged)", result.step, result.step - 1, result.num_groups)


class ModelRef(Protocol):
    """What a backend reads of the model it serves: `tempering.Model` and `TrainableModel` have it.

    The backends depend on the client's models only through these names (they never import
    model.py, which imports them). A backend also reads, where present, `trainable`,
    `lora_config` and ART's `_internal_config` (with getattr: a plain `Model` has none of them),
    and its `close()` awaits the model's `_backend_closed(backend)` (see `ModelClients`).

    Attributes:
        name: the model's name (unique among a backend's models; what requests send as `model`).
        project: the project whose directory holds the model's checkpoints and history.
    """

    name: str
    project: str

    def model_dump(self, *, mode: str = "python", exclude: Any = None) -> dict[str, Any]:
        """The model's fields (pydantic's `model_dump`), stored beside its checkpoints."""
        ...


class ModelClients:
    """The models registered with a backend, whose OpenAI clients the backend's `close()` closes.

    `model.openai_client()` keeps a pool of connections to the backend's server; left open they
    outlive the server (and, in a long test session or notebook, pile up). The backend calls
    `add(model)` in `register` and `await close_all(backend)` in `close`, which awaits each
    model's `_backend_closed(backend)` hook; a model registered with another backend since then
    keeps its client (the hook checks). A failure to close one client is logged, never raised:
    the backend still closes.
    """

    def __init__(self) -> None:
        self._models: dict[int, Any] = {}  # id -> model: a model registered twice is closed once

    def add(self, model: Any) -> None:
        self._models[id(model)] = model

    async def close_all(self, backend: Any) -> None:
        models, self._models = list(self._models.values()), {}
        for model in models:
            hook = getattr(model, "_backend_closed", None)
            if hook is None:
                continue
            try:
                await hook(backend)
            except Exception as exc:  # closing is best effort: the backend must still shut down
                log.debug("closing the OpenAI client of model %r failed: %s: %s",
                          getattr(model, "name", model), type(exc).__name__, exc)


class TrainableModelRef(ModelRef, Protocol):
    """A `ModelRef` that trains.

    Attributes:
        base_model: a built-in model name, a Hugging Face model id or a local model directory.
    """

    base_model: str


@runtime_checkable
class Backend(Protocol):
    """Implemented by `LocalBackend` (everything in this process)."""

    async def register(self, model: ModelRef) -> None:
        """Start serving (and, for a TrainableModel, training) `model`."""

    async def _prepare_backend_for_training(self, model: TrainableModelRef, config: Any = None) -> tuple[str, str]:
        """(OpenAI base_url, api_key) that `model.openai_client()` talks to."""

    def _model_inference_name(self, model: ModelRef, step: int | None = None) -> str:
        """The name to send as `model` in requests: `name` (latest) or `name@step`."""

    async def _get_step(self, model: TrainableModelRef) -> int:
        """The latest trained step (0 before any)."""

    async def train(self, model: TrainableModelRef, trajectory_groups: list[TrajectoryGroup],
                    **options: Any) -> TrainResult:
        """One training step (ART >= 0.5.18 keyword style)."""

    async def _train_model(self, model: TrainableModelRef, trajectory_groups: list[TrajectoryGroup],
                           config: TrainConfig) -> TrainResult:
        """One training step with a TrainConfig (what `model.train` calls)."""

    async def _log(
        self, model: ModelRef, *, split: str, step: int, metrics: dict[str, float], groups: list[TrajectoryGroup]
    ) -> None:
        """Append a history row and store the groups' trajectories."""

    async def _read_history(self, model: ModelRef) -> list[dict[str, Any]]:
        """The model's history rows, oldest first."""

    async def _delete_checkpoint_files(self, model: TrainableModelRef, steps_to_keep: list[int]) -> list[int]:
        """Delete every checkpoint not in `steps_to_keep`; returns the deleted steps."""

    async def close(self) -> None:
        """Stop serving and free the models."""
