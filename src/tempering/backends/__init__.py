"""Backends: where a model's inference and training run."""

from .base import Backend
from .local import LocalBackend
from .remote import RemoteBackend

__all__ = ["Backend", "LocalBackend", "RemoteBackend"]
