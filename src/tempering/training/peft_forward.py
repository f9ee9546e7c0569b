"""The trainer's forward for architectures tempering's packed decoders do not cover.

Such a model runs its own transformers forward, with the LoRA layers PEFT injected into it, on
the trainer's packed rows: packed attention (attention.py) keeps each sequence to itself, layer
recomputation goes through transformers' own switch, and a half-precision model runs under
autocast. The Llama family, Gemma 3 and Qwen3-MoE do not come here (decoder.py,
gemma3_decoder.py, moe.py).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .attention import use_packed_attention
from .batching import Row

__all__ = ["peft_forward_mode", "peft_row_hidden", "quiet_peft"]


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence one FutureWarning: peft 0.21 reads `model.is_gradient_checkpointing`, which
    transformers 5 deprecated in favour of `is_activation_checkpointing`; and, for a mixture of
    experts, the RuntimeWarning that the rank/alpha patterns PEFT itself adds for the fused
    gate/up experts "did not match any targeted module" (they apply: they target a parameter)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*_pattern keys did not match any targeted module.*\.gate_up_proj",
                                category=RuntimeWarning)
        yield


@contextlib.contextmanager
def peft_forward_mode(peft_model: Any, checkpointing: bool) -> Iterator[None]:
    """For the block: packed attention, layer recomputation when `checkpointing`, and with a
    bf16/fp16 model autocast, so that PEFT runs the LoRA matmuls in that dtype on the activations
    instead of copying every activation to float32 (the adapter weights stay float32 for the
    optimizer)."""
    model = peft_model.get_base_model()
    _set_checkpointing(peft_model, checkpointing)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(use_packed_attention(model))
            embeddings = model.get_input_embeddings().weight
            if embeddings.dtype in (torch.bfloat16, torch.float16):
                from peft.helpers import disable_input_dtype_casting

                stack.enter_context(torch.autocast(device_type=embeddings.device.type, dtype=embeddings.dtype))
                stack.enter_context(disable_input_dtype_casting(peft_model))
            yield
    finally:
        _set_checkpointing(peft_model, False)


def peft_row_hidden(peft_model: Any, row: Row, *, lora: bool) -> torch.Tensor:
    """Final hidden states [T, H] of a packed row (`lora=False`: the base model's), inside
    `peft_forward_mode`."""
    with contextlib.nullcontext() if lora else peft_model.disable_adapter():
        return peft_model.get_base_model().get_decoder()(
            input_ids=row.input_ids[None],
            position_ids=row.position_ids[None],
            use_cache=False,
            cu_seq_lens_q=row.cu_seq_lens,
            cu_seq_lens_k=row.cu_seq_lens,
            max_length_q=row.max_seq_len,
            max_length_k=row.max_seq_len,
        ).last_hidden_state[0]  # [T, H]


def _set_checkpointing(peft_model: Any, on: bool) -> None:
    """Recompute each of the transformers model's decoder layers in the backward pass
    (transformers >= 5.23 renamed the methods)."""
    model = peft_model.get_base_model()
    if on:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model.enable_input_require_grads()
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
