"""The service layer: model services (weights + engine + trainer + checkpoints) and the HTTP app."""

from typing import TYPE_CHECKING, Any

from .base_model import DEFAULT_BASE_MODEL, default_model_dir, resolve_base_model
from .registry import ServiceRegistry
from .service import ModelService

if TYPE_CHECKING:
    from .app import create_app

__all__ = ["DEFAULT_BASE_MODEL", "ModelService", "ServiceRegistry", "create_app", "default_model_dir", "resolve_base_model"]


def __getattr__(name: str) -> Any:
    """`create_app`, imported on first use: the HTTP stack (FastAPI) costs a process that never
    serves, such as a worker rank, about 0.6 s of its start."""
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
