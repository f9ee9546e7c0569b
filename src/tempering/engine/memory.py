"""Freed memory: heap memory given back to the operating system (CPU runs), and a GPU's free memory
once PyTorch's caching allocator has given back the blocks it holds unused."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["available_host_bytes", "cuda_free_bytes", "release_free_memory"]


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


def cuda_free_bytes(device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA `device` for this process, after PyTorch's caching allocator has
    given the driver back every block it holds unused (`torch.cuda.empty_cache`).

    Freed tensors' blocks (a backend closed in this process left 40+ GiB of them on a GPU) thus count
    as free. Unused blocks the allocator cannot give back count as taken: those of a live CUDA
    graph's private pool, and the free parts of segments still partly in use. A KV cache, one large
    tensor, cannot be carved from them: on one H200, after other GPU tests in the same process, a
    budget that counted 69 GiB of them as free sized a 51 GiB cache with 33 GiB really free.
    """
    import torch

    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def available_host_bytes() -> int | None:
    """Bytes of host memory available to new allocations (`MemAvailable` of /proc/meminfo; Linux),
    or None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
