"""An out-of-memory error inside a training step, turned into one that names the knob.

A step's memory beyond the weights and the optimizer state is its activations, which grow with
the tokens of one forward/backward pass: `micro_batch_tokens` (a micro-batch holds at least one
whole sequence, so the longest sequence is the floor) and, without gradient checkpointing, every
layer's intermediates. The trainer undoes the step before the error arrives here (trainer.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import OutOfMemoryError

__all__ = ["is_out_of_memory", "memory_knob_named"]

MIN_MICRO_BATCH_TOKENS = 64  # TrainConfig.micro_batch_tokens' least value


# what torch's CPU allocator says when the OS refuses memory: "[enforce fail at alloc_cpu.cpp:127] err == 0.
# DefaultCPUAllocator: can't allocate memory: you tried to allocate 37281792 bytes. Error code 12 (Cannot allocate
# memory)", a plain RuntimeError (torch 2.13); newer versions say "not enough memory"
_CPU_ALLOCATOR = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
                  os.strerror(errno.ENOMEM))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says an allocation failed: torch's OutOfMemoryError (CUDA's caching allocator),
    the CPU allocator's RuntimeError when the OS refuses memory, or Python's MemoryError."""
    if isinstance(exc, OutOfMemoryError):
        return False
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _CPU_ALLOCATOR)


@contextlib.contextmanager
def memory_knob_named(config: Any, *, longest_tokens: int, device: torch.device) -> Iterator[None]:
    """Run a (self-undoing) training step; an allocation failure inside it becomes an
    OutOfMemoryError naming `config.micro_batch_tokens` (a TrainConfig or TrainSFTConfig).

    The failed step's frames are cleared first: the tensors they hold (the activations that did not
    fit) are freed now, not whenever the caller drops the error, and on CUDA the allocator's cached
    blocks go back to the device, so serving goes on with the memory it had.

    Raises:
        OutOfMemoryError: instead of the allocation error, whose text it quotes.
    """
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        traceback.clear_frames(exc.__traceback__)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise OutOfMemoryError(_message(config, longest_tokens, device, cause)) from None


def _message(config: Any, longest_tokens: int, device: torch.device, cause: str) -> str:
    tokens = config.micro_batch_tokens
    smaller = max(MIN_MICRO_BATCH_TOKENS, tokens // 2)
    fixes = []
    if smaller < tokens:
        fixes.append(f"lower TrainConfig(micro_batch_tokens={tokens}) (the tokens of one forward/backward pass; "
                     f"micro_batch_tokens={smaller} about halves the activations' memory)")
    if not config.gradient_checkpointing:
        fixes.append("turn gradient_checkpointing back on (True keeps one tensor per layer, not all of them)")
    if longest_tokens > smaller:
        fixes.append(f"shorten the trajectories (the longest has {longest_tokens} tokens, and a micro-batch holds "
                     "at least one whole sequence)")
    if not fixes:  # the smallest micro-batch, with checkpointing, of short sequences: the weights themselves
        fixes.append(f"free memory on the {'host' if device.type == 'cpu' else 'device'} (other processes), or train "
                     "a smaller model")
    where = "host" if device.type == "cpu" else str(device)
    return (f"a training step ran out of {where} memory ({cause}). The step was undone: nothing was saved and the "
            f"previous step is still the one served. To fit, " + "; or ".join(fixes))
