"""Giving freed heap memory back to the operating system (CPU runs)."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["release_free_memory"]


def release_free_memory() -> None:
    """`malloc_trim(0)`: return the heap memory glibc holds after large frees to the OS (glibc only).

    A CPU training step and the engine's steps allocate and free gigabytes from different threads;
    glibc keeps freed blocks in per-thread arenas, and a LocalBackend process on the default model
    grew by about 1 GB per training step without this (6.4 GB after 4 steps, 2.6 GB with it).
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
