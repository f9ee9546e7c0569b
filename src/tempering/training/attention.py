"""Attention for packed training rows: each sequence attends only to itself, with no dense mask.

transformers can run a row of packed sequences with a block-diagonal mask built from position
restarts, but that mask is dense: a row of T tokens costs T² attention however short its
sequences, and on CPU and for masked GQA it falls to the slow SDPA kernels. Instead the trainer
registers one attention function with transformers' `AttentionInterface` (its documented
extension point) and switches the model to it for the duration of a step:

- on CUDA with PyTorch's `varlen_attn` (FlashAttention-2 inside torch >= 2.10): one call for
  the whole row, given the cumulative sequence lengths;
- elsewhere: one causal SDPA call per sequence.

Either way the cost is Σ len² and a token never sees another sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PACKED_ATTENTION", "packed_attention", "use_packed_attention"]

PACKED_ATTENTION = "tempering_packed"

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence of a [1, heads, T, D] row.

    `kwargs["cu_seq_lens_q"]` ([S + 1] int32 cumulative lengths) says where sequences start.

    Returns:
        ([1, T, heads, D], None), as transformers' attention functions do.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError("packed attention needs one row and cu_seq_lens_q; run it through the trainer")
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    if q.is_cuda and varlen_attn is not None:
        max_len = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0))  # [T, H, D]
        return out[None], None
    bounds = cu.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        parts.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            is_causal=True, scale=scaling, enable_gqa=True,
        ))  # [1, H, len, D]
    return torch.cat(parts, dim=2).transpose(1, 2), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


@contextlib.contextmanager
def use_packed_attention(model: Any) -> Iterator[None]:
    """Run `model` (a transformers model) with packed attention inside the block, then switch back."""
    _register()
    configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
    configs = list({id(c): c for c in configs}.values())
    saved = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        for c, name in zip(configs, saved):
            c._attn_implementation = name
