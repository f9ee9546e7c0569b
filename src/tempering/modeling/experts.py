"""Mixture-of-experts math shared by the engine and the trainer: routing, grouped expert GEMMs, expert LoRA.

A sparse MoE block (Qwen3-MoE; Shazeer et al. 2017, arXiv 1701.06538; Qwen3 technical report,
arXiv 2505.09388) routes each token to its top-k experts by a softmax over the router's logits
(renormalized over the k when `norm_topk_prob`), runs each chosen expert's SwiGLU MLP on it and
sums the outputs weighted by those probabilities. Transformers 5 stores the experts stacked:
`gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I].

The flat (token, slot) pairs are sorted by expert, so each expert's rows are contiguous, and every
projection is ONE grouped GEMM over all experts (`torch._grouped_mm` with the experts' row
offsets on the device: no host sync, so CUDA graphs can capture it; on CPU, torch's fallback of
the same op where it has one). The twin loops over the experts' contiguous row ranges (older
torch, fp32 on CUDA); tests check both against each other and against transformers.
Nothing here is [tokens, experts, hidden]: the largest tensor is [tokens · k, 2I].

LoRA on a stacked parameter is PEFT's `ParamWrapper` (`target_parameters`; PEFT converts the
target modules gate_proj/up_proj/down_proj of a transformers-4 checkpoint to these): per expert
e, ΔW_e = s · B_e A_e with `lora_A.weight` [E·r, in] holding A_e in rows e·r..(e+1)·r and
`lora_B.weight` [out, r·E] holding B_e[:, j] in column j·E + e. `ExpertLoRA` reads those tensors
by reference (never copies), as `collect_adapter` does for the dense projections.

Routing replay (R3, Ma et al. 2025, arXiv 2510.11370): `route(..., replay=ids)` takes the expert
ids the sampler chose instead of its own top-k, and weights them by its own router probabilities,
so the trainer computes the function the engine sampled from.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ExpertBatch", "ExpertLoRA", "MoEDelta", "collect_expert_lora", "experts_of", "grouped_linear",
           "is_moe_layer", "route", "routing_dtype", "sort_by_expert", "sparse_moe"]

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


@functools.cache
def _has_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs on this device and dtype: its CUDA kernels (bf16; Hopper and
    newer in some torch releases) or its CPU fallback (torch 2.9+, several times faster than a loop)."""
    if not HAS_GROUPED_MM or (device.type == "cuda" and dtype != torch.bfloat16):
        return False
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device)
        b = torch.ones(2, 8, 8, dtype=dtype, device=device).transpose(1, 2)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _impl_for(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The `grouped_linear` implementation for "auto": grouped_mm where torch has it for this device
    and dtype and every row is 16-byte aligned (as it requires); the per-expert loop otherwise."""
    aligned = (x.shape[1] * x.element_size()) % 16 == 0 and (weight.shape[1] * weight.element_size()) % 16 == 0
    return "grouped_mm" if aligned and _has_grouped_mm(x.device, x.dtype) else "loop"


def is_moe_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` of a Qwen3-MoE config has a sparse MoE block (else a dense MLP),
    as transformers decides it (`mlp_only_layers`, `decoder_sparse_step`)."""
    return (layer not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0)


def routing_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds an expert id (uint8 up to 256 experts)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def route(router_logits: torch.Tensor, top_k: int, normalize: bool,
          replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing, as transformers' Qwen3MoeTopKRouter computes it.

    Args:
        router_logits: [N, E] in the model dtype.
        top_k: experts per token.
        normalize: renormalize the k probabilities to sum to 1 (`norm_topk_prob`).
        replay: [N, k] integer expert ids to use instead of the top-k (routing replay); rows whose
            first id is negative keep their own top-k. None: no replay.

    Returns:
        (weights [N, k] float32, ids [N, k] int64): softmax probabilities (float32) of the chosen
        experts, renormalized when `normalize`.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if replay is not None:
        replay = replay.long()
        ids = torch.where(replay[:, :1] >= 0, replay, ids)
        weights = probs.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(slots=True)
class ExpertBatch:
    """The N·k (token, slot) pairs of a batch, sorted by expert.

    Attributes:
        token: [M] int64 token of each sorted row (M = N·k).
        inverse: [M] int64 sorted row of each flat pair (token t, slot j) at t·k + j.
        offsets: [E] int32 cumulative row counts: expert e owns rows [offsets[e-1], offsets[e]).
        counts: [E] per-expert row counts on the host (the CPU twin's loop), or None.
    """

    token: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor
    counts: list[int] | None


def sort_by_expert(ids: torch.Tensor, num_experts: int, *, host_counts: bool) -> ExpertBatch:
    """Sort the flat (token, slot) pairs of `ids` [N, k] by expert (stable: token order within an expert).

    `host_counts`: also read the per-expert counts on the host (a sync: the CPU twin only).
    No op here waits for the device otherwise, so a CUDA graph can capture it.
    """
    N, k = ids.shape
    flat = ids.reshape(-1)  # [M]
    sorted_ids, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.index_add_(0, sorted_ids, torch.ones_like(sorted_ids, dtype=torch.int32))  # no bincount: its size syncs
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=ids.device)
    return ExpertBatch(token=order // k, inverse=inverse, offsets=counts.cumsum(0, dtype=torch.int32),
                       counts=counts.tolist() if host_counts else None)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, batch: ExpertBatch, *, impl: str = "auto") -> torch.Tensor:
    """Each expert's rows of x times its own weight: y[rows of e] = x[rows of e] @ weight[e]^T.

    Args:
        x: [M, in], rows sorted by expert (`sort_by_expert`).
        weight: [E, out, in] (the nn.Linear layout of each expert).
        batch: the sorted layout.
        impl: "grouped_mm" (one `torch._grouped_mm`: CUDA kernels, or torch's CPU fallback), "loop"
            (the twin: one matmul per expert with rows, reading the counts on the host), or "auto"
            (`_impl_for`).

    Returns:
        [M, out] in x's dtype; differentiable in x and weight.
    """
    if impl == "auto":
        impl = _impl_for(x, weight)
    if impl == "grouped_mm":
        # weight[e]^T is a column-major [in, out] view of the row-major [out, in]: the layout the kernel wants
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=batch.offsets)
    counts = batch.counts if batch.counts is not None else batch.offsets.diff(prepend=batch.offsets[:1] * 0).tolist()
    pieces, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pieces.append(F.linear(x[start:start + n], weight[e]))
        start += n
    if not pieces:
        return x.new_zeros(0, weight.shape[1])
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


@dataclass(slots=True)
class ExpertLoRA:
    """One adapter's LoRA on one stacked expert parameter [E, out, in]: ΔW_e = scale · B_e A_e.

    Attributes:
        A: PEFT's `lora_A.weight` [E·r, in], by reference (expert-major rows).
        B: PEFT's `lora_B.weight` [out, r·E], by reference (rank-major columns).
        num_experts: E.
        scale: alpha / r.
    """

    A: torch.Tensor
    B: torch.Tensor
    num_experts: int
    scale: float

    @property
    def rank(self) -> int:
        return self.A.shape[0] // self.num_experts

    def stacked(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, r', in], scale · B [E, out, r']) in `dtype`, contiguous, differentiable in PEFT's
        tensors: the `grouped_linear` weights of the shrink and the expand. r' is r rounded up to a
        multiple of 8 with zero rows of A and columns of B (the same delta): grouped GEMMs on a GPU
        need every row 16-byte aligned."""
        E, r = self.num_experts, self.rank
        A = self.A.view(E, r, self.A.shape[1])  # [E, r, in], a view
        B = self.B.view(self.B.shape[0], r, E).permute(2, 0, 1)  # [E, out, r], strided
        pad = -r % 8
        A, B = A.to(dtype), (B * self.scale).to(dtype)
        if pad:
            A, B = F.pad(A, (0, 0, 0, pad)), F.pad(B, (0, pad))
        return A.contiguous(), B.contiguous()


def collect_expert_lora(experts: Any, adapter: str) -> dict[str, ExpertLoRA]:
    """{"gate_up_proj" | "down_proj": ExpertLoRA} of `adapter` on a (PEFT-wrapped) experts module.

    PEFT nests one `ParamWrapper` per targeted parameter around the experts module; each holds
    the LoRA of its `parameter_name`.

    Raises:
        ValueError: for a LoRA variant the engine and trainer do not implement (DoRA, a bias).
    """
    found: dict[str, ExpertLoRA] = {}
    module = experts
    while hasattr(module, "parameter_name"):
        if adapter in module.lora_A:
            if module.use_dora.get(adapter, False) or module.lora_B[adapter].bias is not None:
                raise ValueError("DoRA or biased LoRA on MoE experts is not supported")
            found[module.parameter_name] = ExpertLoRA(module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                                                      module.num_experts, float(module.scaling[adapter]))
        module = module.base_layer
    return found


def experts_of(mlp: Any) -> Any:
    """The stacked-experts module under PEFT's ParamWrappers of a sparse MoE block."""
    module = mlp.experts
    while hasattr(module, "parameter_name"):
        module = module.base_layer
    return module


@dataclass(slots=True)
class MoEDelta:
    """One adapter's expert LoRA in one layer, stacked for `grouped_linear` (see `ExpertLoRA.stacked`).

    Attributes:
        gate_up: (A [E, r, H], s·B [E, 2I, r]) or None.
        down: (A [E, r, I], s·B [E, H, r]) or None.
        rows: [N] bool, the batch rows (tokens) that use this adapter; None: all of them.
    """

    gate_up: tuple[torch.Tensor, torch.Tensor] | None
    down: tuple[torch.Tensor, torch.Tensor] | None
    rows: torch.Tensor | None = None


def _add_delta_(y: torch.Tensor, x: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor], batch: ExpertBatch,
                rows: torch.Tensor | None, impl: str) -> torch.Tensor:
    """y + (x A_e^T) (s B_e)^T per expert row block (out of place when autograd records it)."""
    A, B = lora
    delta = grouped_linear(grouped_linear(x, A, batch, impl=impl), B, batch, impl=impl)  # [M, out]
    if rows is not None:
        delta = delta * rows[batch.token, None].to(delta.dtype)
    return y + delta if torch.is_grad_enabled() else y.add_(delta)


def sparse_moe(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, top_k: int,
               normalize: bool, silu_and_mul, deltas: list[MoEDelta] = (), replay: torch.Tensor | None = None,
               impl: str = "auto", add_delta=None, linear=F.linear, grouped=None,
               fixed_order_sum: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse MoE block: route, grouped SwiGLU experts (with LoRA), the weighted sum over the k.

    Args:
        h: [N, H] normed hidden states.
        router: [E, H] router weight; gate_up: [E, 2I, H]; down: [E, H, I].
        top_k, normalize: `route`'s.
        silu_and_mul: [M, 2I] → [M, I] (the caller's kernel).
        deltas: the adapters' expert LoRAs.
        replay: [N, k] expert ids to route to instead (see `route`), or None.
        impl: `grouped_linear`'s, for every projection.
        add_delta: adds an adapter's expert LoRA delta, `_add_delta_`'s signature (None: it, two
            grouped GEMMs; the engine passes its decode kernels, engine/layers/triton_moe_lora.py).
        linear: the router's product, `F.linear`'s signature.
        grouped: the experts' products, (x, weight, batch) → y as `grouped_linear` (None: it).
        fixed_order_sum: sum the k weighted expert outputs one by one in float32, elementwise (a
            row's result then never depends on the batch), instead of one batched product.
            linear, grouped and this are the batch-invariant engine's (engine/models/qwen3_moe.py).

    Returns:
        (out [N, H] in h's dtype, ids [N, k] int64 the experts used).
    """
    N, H = h.shape
    weights, ids = route(linear(h, router), top_k, normalize, replay)  # [N, k] each
    batch = sort_by_expert(ids, router.shape[0], host_counts=not h.is_cuda)  # a sync only where it costs nothing
    add_delta = add_delta or _add_delta_
    grouped = grouped or functools.partial(grouped_linear, impl=impl)
    xs = h[batch.token]  # [M, H], M = N·k rows sorted by expert
    y = grouped(xs, gate_up, batch)  # [M, 2I]
    for d in deltas:
        if d.gate_up is not None:
            y = add_delta(y, xs, d.gate_up, batch, d.rows, impl)
    act = silu_and_mul(y)  # [M, I]
    y = grouped(act, down, batch)  # [M, H]
    for d in deltas:
        if d.down is not None:
            y = add_delta(y, act, d.down, batch, d.rows, impl)
    y = y[batch.inverse].view(N, top_k, H)  # back to token order
    w = weights.to(h.dtype)
    if fixed_order_sum:  # Σ_j w_j y_j for j = 0, 1, ...: w rounded as bmm's input, products and sums in float32
        out = w[:, 0, None].float() * y[:, 0].float()
        for j in range(1, top_k):
            out = out + w[:, j, None].float() * y[:, j].float()
        return out.to(h.dtype), ids
    out = torch.bmm(w[:, None, :], y)[:, 0]  # [N, H]: Σ_j w_j y_j, no [N, k, H] product
    return out, ids
