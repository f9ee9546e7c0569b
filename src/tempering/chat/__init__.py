"""Rendering chat messages to token ids, shared by the engine and the trainer (a leaf package)."""

from .renderer import ChatRenderer

__all__ = ["ChatRenderer"]
