"""LoRA at inference: the trainer's live adapter tensors, applied without merging.

`y = x W^T + s (x A^T) B^T` with s = alpha / r (Hu et al. 2021, arXiv 2106.09685). A and B are
the very tensors PEFT trains (found on the Hugging Face model's LoRA layers), so when the
optimizer updates them in place, the next engine step samples from the new policy: no reload,
and base weights are never merged.

Three ways, fastest first:

- Spare rows (CUDA, a batch whose rows all use one adapter): the base weights are allocated with
  a few spare rows (`EngineConfig.max_lora_rank` per slice), and `SpareRows.bind` writes the
  adapter's A matrices there in the model dtype, so the base GEMM also computes x A^T: the
  shrink costs nothing. The expand is one Triton kernel per projection (q/k/v, o, down) and is
  fused into the SwiGLU kernel for gate/up. A and B are read from the trainer's tensors; the
  copy of A (r·in values per module) is refreshed whenever any A changed in place (the
  optimizer step; PyTorch's version counters tell), before the next engine step.
  The q/k/v, o and down expands are fused into the kernels that read their outputs next
  (rotary + KV store, add + RMSNorm), which read B^T from shadows in the model dtype ([r, out]
  per module, refreshed with the copy of A): faster at every batch size measured (256 to 8192
  rows on an H100, benchmarks/RESULTS.md).
- Two Triton kernels per projection, a shrink and an expand over all its slices (mixed batches,
  and the batch-invariant mode, with fixed tiles).
- PyTorch matmuls (CPU), the kernels' twins.

Every way rounds as the trainer does (modeling/precision.py): the projection's GEMM output stays
float32 until the delta, round(s · x A^T) B^T, joins it, then one rounding to the model dtype.
The copies of A and B^T follow the trainer's tensors through their version counters, which the
trainer moves after every update (a fused optimizer writes in place without moving them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..modeling.lora import AdapterWeights, collect_adapter
from ..modeling.precision import linear, linear_f32
from .layers.ops import TORCH_OPS

__all__ = ["AdapterWeights", "EngineAdapter", "LoRAGroup", "LoRASegment", "SpareRows", "add_rms_norm_with_lora",
           "collect_adapter", "expand", "linear_with_lora", "linear_with_segments", "lora_silu_and_mul",
           "rotary_and_store_with_lora", "spare_rows_for"]

try:  # the CUDA kernels need Triton, which CPU builds of torch do not bring
    from .layers import triton_lora
except ImportError:  # pragma: no cover - depends on the installation
    triton_lora = None

GROUPS = ("qkv", "o", "gate_up", "down")
SHADOWED = ("qkv", "o", "down")  # groups whose expand can be fused into the next kernel (they get B^T shadows)


@dataclass(slots=True)
class LoRAGroup:
    """The LoRA slices of one fused projection of one layer, ready for the kernels.

    Attributes:
        A: per slice [r, in] (the trainer's tensors, by reference).
        B: per slice [out_s, r].
        columns: per slice, its output columns in the fused projection.
        scales: per slice, alpha / r.
        use_kernels: every slice has the same rank, contiguous tensors, at most 3 slices.
        BT: per slice B^T [r, out_s] in the model dtype, a copy kept by `SpareRows.bind` (None
            until the adapter is first bound; only for the groups in SHADOWED).
    """

    A: list[torch.Tensor]
    B: list[torch.Tensor]
    columns: list[slice]
    scales: list[float]
    use_kernels: bool
    BT: list[torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        """Rows of x A^T for all slices (S · r)."""
        return sum(a.shape[0] for a in self.A)


class EngineAdapter:
    """One adapter as the engine applies it: its tensors grouped per layer and fused projection.

    Args:
        weights: references to the adapter's PEFT tensors (`collect_adapter`).
        out_features: {"o": hidden size, "down": hidden size} for the projections whose output
            is not fused.
    """

    def __init__(self, weights: AdapterWeights, out_features: dict[str, int]) -> None:
        self.weights = weights
        self.name = weights.name
        self.layers: list[dict[str, LoRAGroup | None]] = []
        for layer in weights.layers:
            groups: dict[str, LoRAGroup | None] = {}
            for group in GROUPS:
                entries = layer[group]
                if not entries:
                    groups[group] = None
                    continue
                columns = [e.out if e.out.stop is not None else slice(0, out_features[group]) for e in entries]
                ranks = {e.A.shape[0] for e in entries}
                use_kernels = (
                    len(entries) <= 3 and len(ranks) == 1
                    and all(e.A.is_contiguous() and e.B.is_contiguous() for e in entries)
                )
                groups[group] = LoRAGroup([e.A for e in entries], [e.B for e in entries], columns,
                                          [e.scale for e in entries], use_kernels)
            self.layers.append(groups)


class SpareRows:
    """The spare rows of the engine's base weights, and the adapter whose A matrices fill them.

    Args:
        full: per layer, {"qkv"|"o"|"gate_up"|"down": the weight's whole allocation [out + spare, in]}.
        num_out: {group: out}, the projection's own rows.
        max_rank: spare rows per slice.
    """

    def __init__(self, full: list[dict[str, torch.Tensor]], num_out: dict[str, int], max_rank: int) -> None:
        self.full = full
        self.num_out = num_out
        self.max_rank = max_rank
        self.bound: EngineAdapter | None = None
        self._version = -1
        self._copies: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def fits(self, adapter: EngineAdapter) -> bool:
        return all(g is None or (g.use_kernels and g.A[0].shape[0] <= self.max_rank)
                   for layer in adapter.layers for g in layer.values())

    @staticmethod
    def allocation(num_slices: int, max_rank: int, num_out: int) -> int:
        """Spare rows to allocate after the `num_out` rows of a projection of `num_slices` slices."""
        return spare_rows_for(num_slices * max_rank, num_out)

    def bind(self, adapter: EngineAdapter) -> bool:
        """Make the spare rows hold `adapter`'s current A and its shadows of B^T its current B
        (copies only when some A or B changed); False if it does not fit."""
        if adapter is not self.bound:
            if not self.fits(adapter):
                return False
            dsts, srcs, shadows, bs = [], [], [], []
            for full, layer in zip(self.full, adapter.layers):
                for group, g in layer.items():
                    if g is None:
                        continue
                    row = self.num_out[group]
                    for a in g.A:
                        dsts.append(full[group][row:row + a.shape[0]])
                        srcs.append(a)
                        row += a.shape[0]
                    if group in SHADOWED:
                        if g.BT is None:  # kept with the adapter: graphs captured for it read these addresses
                            g.BT = [torch.empty(b.shape[1], b.shape[0], dtype=full[group].dtype, device=b.device)
                                    for b in g.B]
                        shadows += g.BT
                        bs += [b.T for b in g.B]
            self.bound, self._copies, self._version = adapter, (dsts, srcs, shadows, bs), -1
        dsts, srcs, shadows, bs = self._copies
        # bumped by every in-place change (optimizer, load, undo)
        version = sum(a._version for a in srcs) + sum(b._version for b in bs)
        if version != self._version:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
                for shadow, b in zip(shadows, bs):
                    shadow.copy_(b)
            self._version = version
        return True


def linear_with_lora(x: torch.Tensor, full_w: torch.Tensor, full_b: torch.Tensor | None, num_out: int,
                     g: LoRAGroup | None, defer: bool = False, out_dtype: torch.dtype | None = None,
                     tp: Any = None) -> tuple[torch.Tensor, "Deferred | None"]:
    """x W^T (+ b) plus the bound adapter's delta of group `g`: x A^T comes from the spare rows.

    With an adapter the GEMM's output stays float32, so that the delta joins it before the one
    rounding to the model dtype (modeling/precision.py).

    Args:
        x: [N, in]; full_w: [num_out + spare, in]; full_b: [num_out + spare] or None.
        defer: leave the delta to the kernel that reads the output next (`add_rms_norm_with_lora`,
            `rotary_and_store_with_lora`) when `g` has shadows of B^T; else add it here.
        out_dtype: the output's dtype (default x's); float32 leaves base + delta unrounded (a
            row-parallel layer's partial output, rounded after its all-reduce).
        tp: a row-parallel layer's tensor-parallel group, or None. With a deferred delta the whole
            float32 GEMM output, this rank's partial x W^T and partial x A^T side by side, is
            all-reduced in one collective, and every rank gets the summed output and x A^T, whose
            delta the next kernel adds before the one rounding (as without TP). Otherwise x A^T
            alone is summed first (`row_parallel_delta`), the leader adds the delta to its partial
            output, and the caller all-reduces that.

    Returns:
        (output [N, num_out], the delta still to add or None). The output is in x's dtype, except
        with a deferred delta: then it is the float32 GEMM output (a view with row stride
        num_out + spare_rows_for(S·r, num_out)), which the next kernel completes and rounds.
    """
    out_dtype = out_dtype or x.dtype
    if g is None:
        bias = full_b[:num_out] if full_b is not None else None
        if out_dtype != x.dtype:
            return linear_f32(x, full_w[:num_out], bias).to(out_dtype), None
        return linear(x, full_w[:num_out], bias), None
    rows = num_out + spare_rows_for(g.num_rows, num_out)
    defers = defer and g.BT is not None
    summed = defers and tp is not None  # the ranks' x W^T and x A^T summed in one all-reduce
    buffer = tp.all_reduce_buffer((x.shape[0], rows)) if summed else None  # the GEMM writes where it is summed
    y = linear_f32(x, full_w[:rows], full_b[:rows] if full_b is not None else None, out=buffer)  # [N, rows] float32
    if summed:
        y = tp.all_reduce(y)
    out = y[:, :num_out]
    t = y[:, num_out:num_out + g.num_rows]
    if defers:
        return out, Deferred(t, g)
    if tp is not None:
        t = row_parallel_delta(t, tp)
        if t is None:
            return out.to(out_dtype), None
    return expand(out, t, g.B, g.columns, g.scales, out_dtype, round_dtype=x.dtype), None


def row_parallel_delta(t: torch.Tensor, tp: Any) -> torch.Tensor | None:
    """x A^T of a row-parallel layer under tensor parallelism: this rank's partial sum [N, S·r]
    (float32, or the shrink's [splits, N, S·r]) summed over the group, returned on the leader; None
    on the other ranks, which add no delta.

    The whole x A^T is then rounded once, as one process rounds it, and the delta is added once,
    on the leader's partial output: the ranks' partial outputs then sum (in float32) to what one
    process computes, up to the order of float32 additions. The trainer does the same
    (training/decoder.py)."""
    t = tp.all_reduce(t.sum(0) if t.dim() == 3 else t)
    return t if tp.is_leader else None


@dataclass(slots=True)
class Deferred:
    """A LoRA delta not yet added to a projection's output: t = x A^T [N, S·r] (spare rows) and its group."""

    t: torch.Tensor
    group: LoRAGroup

    def expand(self, y: torch.Tensor) -> torch.Tensor:
        """round(y + the delta) in the model dtype, in PyTorch from the B^T shadows (the CPU twin of
        the fused kernels)."""
        g = self.group
        return _expand_reference(y, self.t, [bt.T for bt in g.BT], g.columns, g.scales, g.BT[0].dtype)


def add_rms_norm_with_lora(x: torch.Tensor, deferred: Deferred | None, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, add_rms_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + Δ + residual), x + Δ + residual) with Δ a deferred o/down delta (one slice, all columns)."""
    if deferred is None:
        return add_rms_norm(x, residual, weight, eps)
    if _kernels_for(x):
        g = deferred.group
        return triton_lora.add_rms_norm_lora(x, deferred.t, g.BT[0], g.scales[0], residual, weight, eps)
    return add_rms_norm(deferred.expand(x), residual, weight, eps)


def rotary_and_store_with_lora(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               deferred: Deferred | None, qkv: torch.Tensor, rotary_and_store_) -> torch.Tensor:
    """`rotary_and_store_` of q, k, v (views of `qkv`) with a deferred q/k/v delta added first.

    Returns:
        the rotated q [N, Hq, D] in the model dtype (q itself, rotated in place, without a delta;
        a new tensor with one, as qkv is then the GEMM's float32 output).
    """
    if deferred is None:
        rotary_and_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return q
    if not _kernels_for(qkv):
        full = deferred.expand(qkv)  # [N, (Hq + 2 Hkv) D], model dtype
        q_size, kv_size = q.shape[1] * q.shape[2], k.shape[1] * k.shape[2]
        q, k, v = (full[:, :q_size].view(q.shape), full[:, q_size:q_size + kv_size].view(k.shape),
                   full[:, q_size + kv_size:].view(v.shape))
        rotary_and_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return q
    g = deferred.group
    rank = g.BT[0].shape[0]
    starts = (0, q.shape[1] * q.shape[2], q.shape[1] * q.shape[2] + k.shape[1] * k.shape[2])  # q, k, v columns in qkv
    by_start = {c.start: (s * rank, bt, scale) for s, (c, bt, scale) in enumerate(zip(g.columns, g.BT, g.scales))}
    slices = [by_start.get(start) for start in starts]
    q_out = torch.empty(q.shape, dtype=g.BT[0].dtype, device=q.device)
    return triton_lora.rotary_and_store_lora_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, deferred.t, slices,
                                              q_out)


def spare_rows_for(num_rows: int, num_out: int) -> int:
    """Spare rows a GEMM computes for `num_rows` of x A^T after the projection's `num_out` rows.

    num_out + spare is a multiple of 64 when that adds under 1% to the rows (the gate/up GEMM
    then runs the base GEMM's cuBLAS kernel: 0.71 instead of 0.76 ms per decode step of a
    1.5B model at batch 256 on an H100), else spare is a multiple of 8, so that every row of the
    output starts 16-byte aligned (FlashAttention and vector loads need it).
    """
    spare = -(-num_rows // 8) * 8
    wide = -(-(num_out + num_rows) // 64) * 64 - num_out
    return wide if wide - spare < num_out / 100 else spare


def expand(y: torch.Tensor, t: torch.Tensor, B: list[torch.Tensor], columns: list[slice], scales: list[float],
           dtype: torch.dtype, *, round_dtype: torch.dtype | None = None) -> torch.Tensor:
    """round(y + round(s · t) @ B^T) over each slice's columns of y, the rest of y rounded: [N, M] in `dtype`.

    Args:
        y: [N, M] the base GEMM's float32 output (or `dtype`: then changed in place and returned).
        t: x A^T, [N, S·r] (any float dtype) or the shrink's [splits, N, S·r] float32 partial sums.
        B, columns, scales: per slice, B [cols_s, r], its output columns and alpha / r.
        round_dtype: the model dtype, where s · t is rounded (default `dtype`).
    """
    if _kernels_for(y) and len(B) <= 3:
        out = y if y.dtype == dtype else torch.empty(y.shape, dtype=dtype, device=y.device)
        return triton_lora.lora_expand_(y, t, B, columns, scales, out=out, round_dtype=round_dtype)
    return _expand_reference(y, t.sum(0) if t.dim() == 3 else t, B, columns, scales, dtype, round_dtype=round_dtype)


def _expand_reference(y: torch.Tensor, t: torch.Tensor, B: list[torch.Tensor], columns: list[slice],
                      scales: list[float], dtype: torch.dtype, *, round_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The PyTorch twin of `triton_lora.lora_expand_` (see `expand`), for x A^T given as [N, S·r]."""
    round_dtype = round_dtype or dtype
    out = y if y.dtype == dtype else y.to(dtype)
    rank = B[0].shape[1]
    for s, (b, cols, scale) in enumerate(zip(B, columns, scales)):
        ts = (t[:, s * rank:(s + 1) * rank].float() * scale).to(round_dtype).float()  # round(s · x A^T)
        out[:, cols] = (y[:, cols].float() + ts @ b.to(round_dtype).float().T).to(dtype)
    return out


def silu_and_mul_with_lora(x: torch.Tensor, full_w: torch.Tensor, num_out: int, g: LoRAGroup | None,
                           silu_and_mul) -> torch.Tensor:
    """silu(gate) * up of x [N, in] through the fused gate/up weight, with the bound adapter's delta
    fused in (gate and up rounded once, after the delta)."""
    if g is None:
        return silu_and_mul(linear(x, full_w[:num_out]))
    y = linear_f32(x, full_w[:num_out + spare_rows_for(g.num_rows, num_out)])  # [N, 2I + spare] float32
    t = y[:, num_out:num_out + g.num_rows]
    if not _kernels_for(y):
        return silu_and_mul(_expand_reference(y[:, :num_out], t, g.B, g.columns, g.scales, x.dtype))
    gate, up = _gate_and_up(g, num_out // 2)
    return triton_lora.silu_and_mul_lora(y[:, :num_out], t, gate[0], up[0], gate[1], up[1], dtype=x.dtype)


def _gate_and_up(g: LoRAGroup, half: int) -> tuple[tuple, tuple]:
    by_start = {c.start: (B, s) for B, c, s in zip(g.B, g.columns, g.scales)}
    return by_start.get(0, (None, 0.0)), by_start.get(half, (None, 0.0))


@dataclass(slots=True)
class LoRASegment:
    """Rows [start, end) of the flat batch use `adapter` (None: the base weights)."""

    start: int
    end: int
    adapter: EngineAdapter | None


def _kernels_for(y: torch.Tensor) -> bool:
    return y.is_cuda and triton_lora is not None


def linear_with_segments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         segments: list[LoRASegment], layer: int, group: str, ops: Any = TORCH_OPS,
                         out_dtype: torch.dtype | None = None, tp: Any = None) -> torch.Tensor:
    """x W^T + b with each segment's LoRA delta of `group` in `layer`, rounded once: [N, in] → [N, out].

    Rows of segments without this projection's LoRA get the plain GEMM, rounded. `ops`
    (layers.ops_for): its products, and with `batch_invariant` the LoRA kernels' fixed tiles.
    `out_dtype`: the output's dtype (default x's); float32 leaves every row unrounded (a
    row-parallel layer's partial output, rounded after its all-reduce). `tp`: a row-parallel
    layer's tensor-parallel group: x A^T is summed over it first (`row_parallel_delta`).
    """
    out_dtype = out_dtype or x.dtype
    active = [(seg, g) for seg in segments if seg.adapter is not None and (g := seg.adapter.layers[layer][group]) is not None]
    if not active:
        return ops.linear(x, weight, bias) if out_dtype == x.dtype else ops.linear_f32(x, weight, bias).to(out_dtype)
    y = ops.linear_f32(x, weight, bias)  # [N, out] float32
    out = y if out_dtype == y.dtype else y.to(out_dtype)
    kernels = _kernels_for(y)
    fixed = ops.batch_invariant
    for seg, g in active:
        rows = slice(seg.start, seg.end)
        if kernels and g.use_kernels:
            t = triton_lora.lora_shrink(x[rows], g.A, fixed_tiles=fixed)
        else:
            t = torch.cat([linear_f32(x[rows], A.to(x.dtype)) for A in g.A], dim=1)  # x A^T, [n, S·r] float32
        if tp is not None and (t := row_parallel_delta(t, tp)) is None:
            continue  # no delta on this rank: its partial output alone (out holds y already)
        if kernels and g.use_kernels:
            triton_lora.lora_expand_(y[rows], t, g.B, g.columns, g.scales, out=out[rows], fixed_tiles=fixed,
                                     round_dtype=x.dtype)
        else:
            out[rows] = _expand_reference(y[rows], t, g.B, g.columns, g.scales, out_dtype, round_dtype=x.dtype)
    return out


def lora_silu_and_mul(h: torch.Tensor, weight: torch.Tensor, segments: list[LoRASegment], layer: int,
                      ops: Any = TORCH_OPS) -> torch.Tensor:
    """silu(gate) * up of h [N, in] through the fused gate/up `weight` [2I, in], with each segment's
    gate/up LoRA delta added before the one rounding.

    On CUDA, a batch with one adapter for every row runs the delta inside the SwiGLU kernel
    (the [N, 2I] projection output is not read and written an extra time); otherwise
    `linear_with_segments` adds it and `ops.silu_and_mul` runs as usual.
    """
    if len(segments) == 1 and _kernels_for(h):
        seg = segments[0]
        g = seg.adapter.layers[layer]["gate_up"] if seg.adapter is not None else None
        if seg.start == 0 and seg.end == h.shape[0] and g is not None and g.use_kernels:
            gate, up = _gate_and_up(g, weight.shape[0] // 2)
            fixed = ops.batch_invariant
            t = triton_lora.lora_shrink(h, g.A, fixed_tiles=fixed)
            return triton_lora.silu_and_mul_lora(ops.linear_f32(h, weight), t, gate[0], up[0], gate[1], up[1],
                                                 dtype=h.dtype, fixed_tiles=fixed)
    return ops.silu_and_mul(linear_with_segments(h, weight, None, segments, layer, "gate_up", ops))
