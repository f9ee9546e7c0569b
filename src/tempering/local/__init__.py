"""ART's module path of the in-process backend: `from art.local import LocalBackend`."""

from ..backends.local import LocalBackend

__all__ = ["LocalBackend"]
