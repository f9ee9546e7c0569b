"""Heavy CPU calls beside the engine, each in a thread of its own, so that the engine's workers spin.

PyTorch's CPU build runs its parallel regions on GNU OpenMP (libgomp), which gives every thread
that opens one a pool of workers of its own, kept until that thread exits. Once the pools of a
process hold more threads than it has cores, libgomp's workers stop spinning between regions and
sleep: each region then waits for a wake-up. A decode step is ~200 small products, one region
each, and beside one other thread's pool the engine's CPU steps take 2.0-2.8x as long at 1-16
rows (the default model with its live adapter, 2-core AMD EPYC, torch 2.13:
benchmarks/cpu_decode.py).

So on a machine without CUDA the engine's thread is the one long-lived thread of tempering that
runs torch in parallel: a training step or a model load runs in a thread that ends with the call
and takes its pool with it (`run_in_own_thread`). On a machine with CUDA the call runs where it
is made: the GPU does the work, and a thread's CUDA state (its current device and stream) stays.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["run_in_own_thread"]

T = TypeVar("T")


def run_in_own_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a new thread (with the caller's context variables), waited for.

    Returns fn's result and raises what fn raised. On a machine with CUDA, fn runs in the
    calling thread.
    """
    if torch.cuda.is_available():
        return fn(*args, **kwargs)
    outcome: dict[str, Any] = {}
    context = contextvars.copy_context()

    def call() -> None:
        try:
            outcome["result"] = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=call, name=f"{threading.current_thread().name}-call", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome.pop("error")
    return outcome["result"]
