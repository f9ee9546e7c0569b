"""Attention for packed training rows: each sequence attends only to itself, with no dense mask.

transformers can run a row of packed sequences with a block-diagonal mask built from position
restarts, but that mask is dense: a row of T tokens costs T² attention however short its
sequences, and on CPU and for masked GQA it falls to the slow SDPA kernels. Instead the trainer
registers one attention function with transformers' `AttentionInterface` (its documented
extension point) and switches the model to it for the duration of a step:

- on CUDA with PyTorch's `varlen_attn` (FlashAttention-2 inside torch >= 2.10) in bfloat16 or
  float16: one call for the whole row, given the cumulative sequence lengths;
- a float32 model on CUDA: one SDPA call per group of sequences of about the same length, padded
  to the group's longest (a boolean mask), since FlashAttention takes half precision only and a
  call per sequence and layer would leave the GPU waiting on the host;
- on the CPU: one causal SDPA call per sequence.

Either way the cost is about Σ len² (the padded calls: at most about 4×) and a token never sees
another sequence.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PACKED_ATTENTION", "gather_keys", "packed_attention", "padded_causal_attention", "use_packed_attention",
           "uses_varlen", "varlen_causal_attention"]

PACKED_ATTENTION = "tempering_packed"


@functools.cache
def _varlen_attn() -> Callable[..., torch.Tensor] | None:
    """PyTorch's `varlen_attn`, or None before torch 2.10. Imported at its first use on a GPU:
    importing it loads torch's compiler stack, about 2 s of every process's start on a CPU, where
    it never runs."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


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
    out = varlen_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu,
                                  kwargs.get("max_length_q"), scaling, window=kwargs.get("sliding_window"))
    return out[None], None


def uses_varlen(t: torch.Tensor) -> bool:
    """Whether `varlen_causal_attention` runs FlashAttention (one call, graph-safe) for queries of
    `t`'s device and dtype: on CUDA, torch >= 2.10, half precision. Otherwise it loops over the
    sequences on the host."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                            max_seq_len: int | None, scale: float | None, *, window: int | None = None,
                            keys: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """Causal attention of each packed segment, differentiable.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (Hq a multiple of Hkv: grouped-query attention).
        cu_seq_lens: [S + 1] int32 cumulative segment lengths (the queries).
        max_seq_len: the longest segment (computed when None).
        scale: softmax scale (1/sqrt(D) when None).
        window: sliding attention window (Mistral, some Qwen2 layers): token i sees tokens j with
            i - window < j <= i, as transformers' sliding-window mask; None: the whole prefix.
        keys: (key_index [K] int64, cu_keys [S + 1] int32, the most keys of a segment) when a
            segment attends to more keys than its own tokens (a shared prompt's, then its own:
            batching.py); its queries are the last tokens of its keys (bottom-right causal).
            None: each segment attends to itself.

    Returns:
        [T, Hq, D].
    """
    if keys is not None:  # the gradient of a shared prompt's keys sums over the segments that read them
        key_index, cu_keys, max_keys = keys
        k, v = gather_keys(k, key_index, cu_keys[-1]), gather_keys(v, key_index, cu_keys[-1])
    else:
        cu_keys, max_keys = cu_seq_lens, None
    if uses_varlen(q):
        max_len = int(max_seq_len or int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max()))
        max_keys = max_keys or max_len
        left = window - 1 if window is not None and window < max_keys else -1
        return _varlen_attn()(q, k, v, cu_seq_lens, cu_keys, max_len, max_keys, scale=scale,
                              window_size=(left, 0))
    if q.is_cuda:
        return padded_causal_attention(q, k, v, cu_seq_lens, cu_keys, scale, window=window)
    bounds, key_bounds = cu_seq_lens.tolist(), cu_keys.tolist()
    parts = []
    for start, end, key_start, key_end in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]):
        n, m, mask = end - start, key_end - key_start, None
        if m != n or (window is not None and window < n):  # queries end-aligned with their keys
            i = torch.arange(n, device=q.device)[:, None] + (m - n)
            j = torch.arange(m, device=q.device)[None, :]
            mask = (j <= i) & (j > i - window) if window is not None else j <= i  # [n, m]
        parts.append(F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k[key_start:key_end].transpose(0, 1)[None],
            v[key_start:key_end].transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1))  # [len, Hq, D]
    return torch.cat(parts, dim=0)


def padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                            cu_keys: torch.Tensor, scale: float | None, *, window: int | None = None) -> torch.Tensor:
    """`varlen_causal_attention`'s result in a few SDPA calls: the segments grouped by the power of
    two their key count rounds up to, each group padded to its longest.

    Args:
        q: [T, Hq, D]; k, v: [K, Hkv, D], segment s's keys at cu_keys[s]:cu_keys[s + 1] and its
            queries (the last of its keys' positions) at cu_seq_lens[s]:cu_seq_lens[s + 1].
        cu_seq_lens, cu_keys: [S + 1] int cumulative lengths; window as `varlen_causal_attention`.

    Returns:
        [T, Hq, D]; rows past cu_seq_lens[-1] (a row's padding) are zero.

    A group's segments hold at least half its longest's keys, so the padded attention and mask
    cost at most about 4 × Σ queries × keys, in at most log2(longest) + 1 calls; one host sync.
    """
    T, num_heads, _ = q.shape
    bounds, key_bounds = torch.stack([cu_seq_lens.long(), cu_keys.long()]).tolist()
    groups: dict[int, list[int]] = {}
    for s in range(len(bounds) - 1):
        if bounds[s + 1] > bounds[s]:
            groups.setdefault((key_bounds[s + 1] - key_bounds[s]).bit_length(), []).append(s)
    out = q.new_zeros(T + 1, num_heads, q.shape[2])  # row T: where padded queries' outputs go, dropped
    for segments in groups.values():
        out = out.index_copy(0, *_padded_group(q, k, v, segments, bounds, key_bounds, scale, window, T))
    return out[:T]


def _padded_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int], bounds: list[int],
                  key_bounds: list[int], scale: float | None, window: int | None,
                  dump_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination rows [B * L], outputs [B * L, Hq, D]) of one group's B segments padded to L
    queries and M keys; a padded query's destination is `dump_row`."""
    device = q.device
    lens = [bounds[s + 1] - bounds[s] for s in segments]
    key_lens = [key_bounds[s + 1] - key_bounds[s] for s in segments]
    L, M = max(lens), max(key_lens)
    starts, key_starts, lens_t, key_lens_t = torch.tensor(
        [[bounds[s] for s in segments], [key_bounds[s] for s in segments], lens, key_lens]).to(device)
    l, m = torch.arange(L, device=device), torch.arange(M, device=device)
    q_valid, k_valid = l < lens_t[:, None], m < key_lens_t[:, None]  # [B, L], [B, M]
    pos = (l + (key_lens_t - lens_t)[:, None])[:, :, None]  # each query's own key position, [B, L, 1]
    mask = k_valid[:, None, :] & (m <= pos)
    if window is not None:
        mask &= m > pos - window
    mask |= ~q_valid[:, :, None] & (m == 0)  # a padded query reads one key (dropped): no all-masked NaN row
    group = q.shape[1] // k.shape[1]
    rows = torch.where(q_valid, starts[:, None] + l, dump_row)  # [B, L]
    key_rows = torch.where(k_valid, key_starts[:, None] + m, 0)
    o = F.scaled_dot_product_attention(
        q[rows.clamp(max=q.shape[0] - 1)].transpose(1, 2), k[key_rows].transpose(1, 2).repeat_interleave(group, dim=1),
        v[key_rows].transpose(1, 2).repeat_interleave(group, dim=1), attn_mask=mask[:, None], scale=scale)
    return rows.reshape(-1), o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])


class _GatherKeys(torch.autograd.Function):
    """x[index] whose backward sums the gradient of the first `num_read` entries only.

    A padded row's key entries past the last segment's (batching.py: their count is a power of
    two) are read by no segment, and FlashAttention's varlen backward leaves their gradient
    uninitialized: summed into x's gradient it made the LoRA gradients NaN or ~1e6 on real
    weights (rows with shared prompts, replayed from CUDA graphs). `torch.where` drops them
    whatever they hold.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, num_read: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index, num_read)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, num_read = ctx.saved_tensors
        read = torch.arange(grad.shape[0], device=grad.device) < num_read  # no host sync: graph-safe
        grad = torch.where(read.view(-1, *[1] * (grad.dim() - 1)), grad, 0)
        return grad.new_zeros(ctx.num_rows, *grad.shape[1:]).index_add_(0, index, grad), None, None


def gather_keys(x: torch.Tensor, key_index: torch.Tensor, num_read: torch.Tensor) -> torch.Tensor:
    """x[key_index] ([K, ...]) for the attention keys of segments that read shared prompts; only the
    first `num_read` entries (0-dim int tensor, cu_keys[-1]) pass a gradient back to x."""
    return _GatherKeys.apply(x, key_index, num_read)


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
