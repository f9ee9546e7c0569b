"""`get_model_step`: a model's latest saved step, read from its checkpoints on disk (ART's `art.utils`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import BackendError
from ..storage.checkpoints import latest_step
from ..storage.layout import ModelPaths

__all__ = ["get_model_step"]


def get_model_step(model: Any, art_path: str | Path | None = None) -> int:
    """The highest step saved under `<art_path>/<project>/models/<name>/checkpoints/` (0 if none).

    ART's signature and behaviour: synchronous, read from the storage directory, so it works
    before the model is registered (to resume, say). Without `art_path`, the storage root of the
    `LocalBackend` the model is registered with is used. `await model.get_step()` asks the
    backend instead and works with any backend, a remote one included.

    Args:
        model: a `Model` or `TrainableModel` (its `project` and `name` are used).
        art_path: the storage root, as passed to `LocalBackend(path=...)` (ART's `.art`).

    Raises:
        BackendError: without `art_path`, if the model is not registered with a backend whose
            storage is on this machine.
        ConfigError: if the model's name or project is not a valid directory name.
    """
    if art_path is None:
        backend = getattr(model, "_backend", None)
        art_path = getattr(backend, "path", None)
        if art_path is None:
            where = "is not registered" if backend is None else f"is served by a {type(backend).__name__}"
            raise BackendError(f"get_model_step: model {model.name!r} {where}, with no storage directory on this "
                               "machine; pass art_path (the LocalBackend's path), or use `await model.get_step()`")
    return latest_step(ModelPaths(Path(art_path), model.project, model.name).checkpoints_dir)
