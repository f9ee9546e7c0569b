"""Backends: where a model's inference and training run."""

from .base import Backend
from .local import LocalBackend

__all__ = ["Backend", "LocalBackend"]
