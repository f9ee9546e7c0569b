"""The service layer: model services (weights + engine + trainer + checkpoints) and the HTTP app."""

from .app import create_app
from .base_model import DEFAULT_BASE_MODEL, default_model_dir, resolve_base_model
from .registry import ServiceRegistry
from .service import ModelService

__all__ = ["DEFAULT_BASE_MODEL", "ModelService", "ServiceRegistry", "create_app", "default_model_dir", "resolve_base_model"]
