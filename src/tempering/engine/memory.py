"""Freed memory: heap memory given back to the operating system (CPU runs), and a GPU's free memory
once PyTorch's caching allocator has given back the blocks it holds unused; the startup heap kept
out of the garbage collector's scans."""

from __future__ import annotations

import ctypes
import gc
import sys

__all__ = ["available_host_bytes", "cuda_free_bytes", "freeze_heap", "release_free_memory", "unfreeze_heap"]


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic garbage collector's scans
    (`gc.freeze`), once a model is loaded.

    The modules a served model imports (torch, transformers, FastAPI, pydantic, openai) leave about
    550k container objects, and each full collection walked all of them: 0.3 s a collection, about
    1 s of every agent gather's 9-10 s of host work (128 conversations x 6 turns, the engine
    answering at once; CPU). Frozen objects are still freed by reference counting; only a cycle
    among them waits for `unfreeze_heap`. vLLM freezes its heap after startup the same way.
    """
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """Give the frozen objects back to the collector (`gc.unfreeze`) and collect: the reference
    cycles of a closed model (its services' engine callbacks) go."""
    gc.unfreeze()
    gc.collect()


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
