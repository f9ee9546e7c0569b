"""The trainer's own forward pass for the Llama family: packed rows, fused LoRA, fused kernels.

Running the PEFT-wrapped transformers model costs a training step about as much time in small
elementwise kernels as in matrix products: PEFT adds each LoRA delta in three extra passes over
the projection's output, and q/k/v and gate/up are separate projections with separate LoRAs.
This forward reads the very same tensors (base weights as the fused q/k/v and gate/up views the
engine uses; LoRA A/B as PEFT's own parameters, so the optimizer, checkpoints and the engine are
unchanged) and computes, per projection group,

    y = [x | round(s · x A_cat^T)] @ [W | B_blockdiag]^T + b    (one GEMM for the base and all LoRAs)

with A_cat the stacked A's and B_blockdiag the block-diagonal of the B's (see _LoRALinear), rounded
where the engine rounds (modeling/precision.py), plus fused RMSNorm and
SwiGLU with their backward passes (kernels.py). Attention is varlen over the packed row
(attention.py); each decoder layer is optionally recomputed in the backward pass (a layer whose
activations are kept keeps SwiGLU's input, not its output as well). The math is
Hugging Face's: tests check logprobs and LoRA gradients against the PEFT model.

References: LoRA (Hu et al. 2021, arXiv 2106.09685); Llama (arXiv 2302.13971); selective layer
recomputation (Chen et al. 2016, arXiv 1604.06174).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..modeling import SUPPORTED_ARCHITECTURES, covered_architecture
from ..modeling.lora import collect_adapter
from ..modeling.precision import linear_f32
from ..modeling.tensor_parallel import all_gather_rows, reduce_scatter_rows
from ..modeling.weights import base_layer, fuse_linears
from .attention import varlen_causal_attention
from .kernels import ops_for

if TYPE_CHECKING:
    from ..modeling.tensor_parallel import TensorParallel

__all__ = ["PackedDecoder", "lora_linear"]

log = logging.getLogger("tempering")


@dataclass(slots=True)
class _GroupLoRA:
    """All LoRAs of one fused projection (q/k/v, o, gate/up or down)."""

    A: list[torch.Tensor]  # each [r_i, in], PEFT's parameters
    B: list[torch.Tensor]  # each [out_i, r_i]
    scales: list[float]  # alpha_i / r_i
    rows: list[slice]  # the fused output rows each B writes
    dropout: float

    def delta_inputs(self, dtype: torch.dtype, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A_cat [R, in], B_full [out_features, R], scales [R] float32), R = Σ r_i: the stacked A's
        and a block-diagonal matrix holding each B_i at its rows and columns (zero elsewhere), in
        `dtype`, and each column's s_i, so that (s ⊙ x A_cat^T) B_full^T is every LoRA delta of
        the group at once."""
        A = self.A[0] if len(self.A) == 1 else torch.cat(self.A, dim=0)
        R = A.shape[0]
        pieces, row, col = [], 0, 0
        for B, rows in sorted(zip(self.B, self.rows), key=lambda e: e[1].start or 0):
            start, stop = rows.start or 0, out_features if rows.stop is None else rows.stop
            if start > row:
                pieces.append(B.new_zeros(start - row, R))
            r = B.shape[1]
            pieces.append(F.pad(B, (col, R - col - r)))
            row, col = stop, col + r
        if row < out_features:
            pieces.append(pieces[0].new_zeros(out_features - row, R))
        B_full = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        scales = torch.cat([torch.full((a.shape[0],), s, dtype=torch.float32, device=A.device)
                            for a, s in zip(self.A, self.scales)])
        return A.to(dtype), B_full.to(dtype), scales


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    lora: dict[str, _GroupLoRA]
    window: int | None  # sliding attention window of this layer

    @property
    def out_features(self) -> dict[str, int]:
        return {"qkv": self.qkv.shape[0], "o": self.o.shape[0], "gate_up": self.gate_up.shape[0],
                "down": self.down.shape[0]}


class _LoRALinear(torch.autograd.Function):
    """y = x W^T + b + (s ⊙ x' A^T) B^T with a frozen W and b, rounded once (modeling/precision.py).

    x' A^T is accumulated in float32 and rounded to the model dtype after scaling by each
    column's s: t = round(s ⊙ x' A^T), the engine's delta input. Then, when the output is wider
    than the input (q/k/v, gate/up): ONE matrix product, [x | t] @ [W | B]^T, appending t to the
    base GEMM's inner dimension (k / in more FLOPs, ~1%), whose float32 accumulation holds base
    and delta before the one rounding. Otherwise (o, down): x W^T and t B^T in float32, added,
    rounded (passes over the narrow output, cheaper than copying the wide input).

    Backward: the input gradient is grad_y (W + B diag(s) A) — the LoRA merged into a temporary
    copy of the weight, one GEMM with no extra pass over the activations — and only the LoRA
    weights' gradients are computed, never the frozen W's. x' is x, or x after LoRA dropout
    (then the two input gradients are kept apart).

    `skip_output` (used when a checkpointed layer is recomputed for its backward, which needs
    only the tensors saved here) saves the same tensors but leaves y uncomputed.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, A, B, scales, x_lora, skip_output, out_dtype, tp, gather, scatter):
        x_saved = x
        if gather is not None:  # sequence parallel: x is this rank's block of rows; the layer reads them all
            x = x_lora = all_gather_rows(x, gather)
        T, (out_features, in_features) = x.shape[0], weight.shape
        xa = linear_f32(x_lora, A)  # [T, k r] float32
        if tp is not None:  # a row-parallel layer: x A^T summed over the ranks, rounded once (as one process)
            dist.all_reduce(xa, group=tp.group)
        t = (xa * scales).to(x.dtype)  # [T, k r]: round(s ⊙ x A^T)
        adds_delta = tp is None or tp.is_leader  # under TP the delta joins the leader's partial output only
        fold_input = in_features < out_features and out_dtype == x.dtype and tp is None
        if skip_output:
            rows = T // dist.get_world_size(scatter) if scatter is not None else T
            y = x.new_empty(rows, out_features, dtype=x.dtype if scatter is not None else out_dtype)
        elif fold_input:
            y = F.linear(torch.cat([x, t], dim=1), torch.cat([weight, B], dim=1), bias)
        else:
            y = linear_f32(x, weight, bias)
            y = (y + linear_f32(t, B) if adds_delta else y).to(out_dtype)
            if scatter is not None:  # sequence parallel: the sum of this rank's block of rows, rounded once
                y = reduce_scatter_rows(y, scatter).to(x.dtype)
        # sequence parallel: the block alone is kept, and gathered again in the backward
        ctx.save_for_backward(x_saved if gather is not None else x_lora, t, weight, A, B, scales)
        ctx.same_input, ctx.fold_input, ctx.adds_delta = x_lora is x, fold_input, adds_delta
        ctx.gather, ctx.scatter = gather, scatter
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_lora, t, weight, A, B, scales = ctx.saved_tensors
        grad_y = grad_y.to(t.dtype)  # a float32 output's gradient, in the model dtype of the GEMMs below
        if ctx.scatter is not None:  # the gradient of every row, from the ranks' blocks
            grad_y = all_gather_rows(grad_y, ctx.scatter)
        gathering = None
        if ctx.gather is not None:  # the input's rows again, gathered while the input gradient's GEMM runs
            x_lora, gathering = all_gather_rows(x_lora, ctx.gather, async_op=True)
        in_features = weight.shape[1]
        s = scales.to(B.dtype)
        # d/dx of x W^T + (s ⊙ x A^T) B^T is W + B diag(s) A (when the LoRA branch sees x itself)
        w_input = torch.addmm(weight, B * s, A) if ctx.same_input else weight  # [out, in]
        if ctx.fold_input and ctx.gather is None:  # the wide gradient: one GEMM for the input's and the rank-k inputs'
            grad_cat = grad_y @ torch.cat([w_input, B], dim=1)  # [T, in + k r]
            grad_x, grad_low = grad_cat[:, :in_features], grad_cat[:, in_features:] * s
        else:
            grad_x, grad_low = grad_y @ w_input, (grad_y @ B) * s  # [T, in], [T, k r]
        # [out, k r]; under TP B is replicated and its gradient summed over the ranks: the leader's alone
        grad_B = grad_y.T @ t if ctx.adds_delta else torch.zeros_like(B)
        if gathering is not None:
            gathering.wait()
            grad_x = reduce_scatter_rows(grad_x, ctx.gather)  # this rank's block of the summed input gradient
        grad_A = grad_low.T @ x_lora  # [k r, in]
        if ctx.same_input:
            return grad_x, None, None, grad_A, grad_B, None, None, None, None, None, None, None
        return grad_x, None, None, grad_A, grad_B, None, grad_low @ A, None, None, None, None, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
                scale: float | torch.Tensor, x_lora: torch.Tensor | None = None, *,
                skip_output: bool = False, out_dtype: torch.dtype | None = None,
                tp: TensorParallel | None = None, gather: Any = None, scatter: Any = None) -> torch.Tensor:
    """x W^T + b + (scale ⊙ x_lora A^T) B^T with a frozen W and b, rounded once (see _LoRALinear).

    Args:
        x: [T, in]; weight: [out, in]; bias: [out] or None; A: [k r, in]; B: [out, k r], all one dtype.
        scale: alpha / r, one float or a [k r] tensor (a value per column of x A^T).
        x_lora: the LoRA branch's input (x after dropout); x when None.
        skip_output: return an uninitialized [T, out] (a recomputation that needs only the saved tensors).
        out_dtype: the output's dtype (default x's). float32 leaves base + delta unrounded: a
            row-parallel layer's partial output, rounded after its all-reduce.
        tp: a row-parallel layer's tensor-parallel group (o, down of a sharded model): x A^T is
            summed over the ranks before its rounding and the delta joins the leader's partial
            output alone, as the engine does (engine/lora.row_parallel_delta).
        gather: sequence parallelism's process group (of P ranks) for a column-parallel layer: x is
            this rank's block of T / P rows, gathered into [T, in] for the product and kept as the
            block for the backward, which gathers it again and reduce-scatters the input gradient
            into [T / P, in]. Needs x_lora None (no dropout).
        scatter: the same group for a row-parallel layer: its float32 partial output [T, out] is
            reduce-scattered, rounded to x's dtype once, and [T / P, out] (this rank's rows) returned.

    Returns:
        [T, out] ([T / P, out] with `scatter`).

    Raises:
        ValueError: if the weight or bias requires a gradient.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("lora_linear trains only A and B; the base weight and bias must be frozen")
    if gather is not None and x_lora is not None and x_lora is not x:
        raise ValueError("lora_linear gathers the rows of x only when the LoRA branch reads x itself (no dropout)")
    if not torch.is_tensor(scale):
        scale = torch.full((A.shape[0],), float(scale), dtype=torch.float32, device=A.device)
    return _LoRALinear.apply(x, weight, bias, A, B, scale, x if x_lora is None else x_lora, skip_output,
                             out_dtype or x.dtype, tp, gather, scatter)


def _group(entries: list[Any], module_dropouts: list[float]) -> _GroupLoRA | None:
    if not entries:
        return None
    return _GroupLoRA([e.A for e in entries], [e.B for e in entries], [e.scale for e in entries],
                      [e.out for e in entries], max(module_dropouts, default=0.0))


def _dropout_p(module: Any, adapter: str) -> float:
    dropouts = getattr(module, "lora_dropout", None)
    if dropouts is None or adapter not in dropouts:
        return 0.0
    return float(getattr(dropouts[adapter], "p", 0.0))  # nn.Dropout, or nn.Identity for 0


class PackedDecoder:
    """Final hidden states [T, H] of one packed row, differentiable in the LoRA parameters.

    Build it with `PackedDecoder.maybe(peft_model)`, which returns None for architectures it does
    not cover (the trainer then runs the transformers model itself).

    `tp`: this rank's tensor-parallel group when the model holds its shards (modeling/tensor_parallel.py):
    the layers run this rank's heads and MLP columns. With `sequence_parallel` (the default under
    TP; for rows whose T divides by P, which the trainer pads them to) each rank holds T/P rows
    between the layers: q/k/v and gate/up gather the rows, o and down reduce-scatter their float32
    partial outputs, LoRA deltas included, rounded to the model dtype once after the sum, as the
    engine does. Otherwise
    `tp.copy_to` precedes q/k/v and gate/up (their input gradient is summed over the ranks in the
    backward pass) and `tp.reduce_from` all-reduces o's and down's partial outputs.
    """

    # without tensor parallelism (and in the subclasses, which have none: Gemma 3, Qwen3-MoE)
    tp: TensorParallel | None = None
    partial_dtype: torch.dtype | None = None
    sequence_parallel: bool = False

    def __init__(self, peft_model: Any, adapter: str, tp: TensorParallel | None = None) -> None:
        hf = peft_model.get_base_model()
        config = hf.config
        inner = hf.model
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.partial_dtype = torch.float32 if self.tp is not None else None  # o's and down's outputs under TP
        # under TP, split the tokens between the sharded layers too (Korthikanti et al. 2022)
        self.sequence_parallel = self.tp is not None
        tp_size = self.tp.size if self.tp is not None else 1
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp_size  # this rank's heads
        self.num_kv_heads = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.embed = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.final_norm = inner.norm.weight
        hf_layers = list(inner.layers)
        slices: dict[str, dict[str, slice]] = {}
        fused = []
        for layer in hf_layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias, slices["qkv"] = fuse_linears(
                [base_layer(attn.q_proj), base_layer(attn.k_proj), base_layer(attn.v_proj)], ["q_proj", "k_proj", "v_proj"])
            gate_up, gate_up_bias, slices["gate_up"] = fuse_linears(
                [base_layer(mlp.gate_proj), base_layer(mlp.up_proj)], ["gate_proj", "up_proj"])
            fused.append((qkv, qkv_bias, gate_up, gate_up_bias))
        adapter_weights = collect_adapter(hf_layers, adapter, slices)
        self.layers: list[_Layer] = []
        for i, (layer, (qkv, qkv_bias, gate_up, gate_up_bias), groups) in enumerate(
                zip(hf_layers, fused, adapter_weights.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            modules = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
                       "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
            lora = {}
            for name, entries in groups.items():
                group = _group(entries, [_dropout_p(m, adapter) for m in modules[name]])
                if group is not None:
                    lora[name] = group
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=qkv_bias,
                q_norm=q_norm.weight if q_norm is not None else None, k_norm=k_norm.weight if k_norm is not None else None,
                o=base_layer(attn.o_proj).weight, o_bias=base_layer(attn.o_proj).bias,
                post_norm=layer.post_attention_layernorm.weight, gate_up=gate_up, gate_up_bias=gate_up_bias,
                down=base_layer(mlp.down_proj).weight, down_bias=base_layer(mlp.down_proj).bias, lora=lora,
                window=_sliding_window(config, i),
            ))
        self.ops = ops_for(self.final_norm.device)
        # whether any LoRA applies dropout (random numbers in the forward)
        self.has_dropout = any(g.dropout > 0 for layer in self.layers for g in layer.lora.values())

    @classmethod
    def maybe(cls, peft_model: Any, adapter: str, tp: TensorParallel | None = None) -> PackedDecoder | None:
        """A decoder for `peft_model`, or None if its architecture or adapter is not covered."""
        hf = peft_model.get_base_model()
        config = hf.config
        if covered_architecture(hf, SUPPORTED_ARCHITECTURES) is None:
            return None
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(peft_model.peft_config[adapter], "use_dora", False):
            return None
        q_rows = base_layer(hf.model.layers[0].self_attn.q_proj).weight.shape[0]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        tp_size = tp.size if tp is not None else 1
        if q_rows * tp_size != config.num_attention_heads * head_dim:
            raise ConfigError(f"q_proj has {q_rows} rows, {config.num_attention_heads * head_dim} / {tp_size} "
                              "expected: a model sharded by modeling.tensor_parallel.shard_llama_ trains only with the same "
                              "group as tp")
        try:
            return cls(peft_model, adapter, tp)
        except ValueError as exc:
            log.info("training with the transformers forward: %s", exc)
            return None

    # ---- forward ------------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seq_lens: torch.Tensor,
                 max_seq_len: int, *, keys: tuple[torch.Tensor, torch.Tensor, int] | None = None, lora: bool = True,
                 checkpointing: bool = False) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: [T] int64 token ids of the packed row.
            position_ids: [T] int64, each token's position in its own sequence.
            cu_seq_lens: [S + 1] int32 cumulative segment lengths.
            max_seq_len: the longest segment.
            keys: the attention keys of segments that read a shared prompt (`Row.keys`), or None.
            lora: False runs the base model (the adapter switched off, as for a KL reference).
            checkpointing: recompute each layer in the backward pass instead of keeping its activations.

        Returns:
            [T, H] in the model dtype.
        """
        x = F.embedding(input_ids, self.embed.weight)  # [T, H]
        cos, sin = self.rotary_emb(x, position_ids[None])  # [1, T, D] each, in x's dtype
        cos, sin = cos[0], sin[0]
        recompute = checkpointing and torch.is_grad_enabled()
        # sequence parallel: between the sharded layers (norms, residual adds) each rank holds T / P rows
        sp = self.sequence_parallel and self.tp is not None and x.shape[0] % self.tp.size == 0
        if sp:
            x = self.tp.shard_tokens(x)
        for layer in self.layers:
            # the stacked A's and block-diagonal B's in the model dtype, built once per forward
            # (not again when the layer is recomputed)
            adapters = {name: g.delta_inputs(x.dtype, layer.out_features[name]) for name, g in layer.lora.items()} if lora else {}
            if recompute:
                # the RNG state matters only to dropout (and reading it is not allowed in a CUDA graph capture)
                x = checkpoint(_Recomputable(self._layer), layer, x, cos, sin, cu_seq_lens, max_seq_len, adapters, keys,
                               sp, use_reentrant=False, preserve_rng_state=self.has_dropout)
            else:
                # its activations kept for the backward (when one is recorded): the layer may keep less
                x = self._layer(layer, x, cos, sin, cu_seq_lens, max_seq_len, adapters, keys, sp,
                                keeps_activations=torch.is_grad_enabled())
        x = self.ops.rms_norm(x, self.final_norm, self.eps)
        return self.tp.gather_tokens(x, replicated_grad=True) if sp else x  # every rank computes the same loss

    def _layer(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seq_lens: torch.Tensor,
               max_seq_len: int, adapters: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               keys: tuple[torch.Tensor, torch.Tensor, int] | None = None, sp: bool = False, *,
               recomputing: bool = False, keeps_activations: bool = False) -> torch.Tensor:
        """One decoder layer: x [T, H] → [T, H]; with `sp` (sequence parallel) this rank's rows,
        [T / P, H] → [T / P, H], gathered for q/k/v and gate/up and reduce-scattered after o and down.
        `keeps_activations`: called outside torch.utils.checkpoint (whose own saved-tensor hooks are
        not to be nested inside) with autograd recording: SwiGLU's output is kept as its recipe."""
        ops, tp = self.ops, self.tp
        T = x.shape[0] * tp.size if sp else x.shape[0]
        h = ops.rms_norm(x, layer.input_norm, self.eps)
        if tp is not None and not sp:
            h = tp.copy_to(h)
        qkv = self._linear(h, layer.qkv, layer.qkv_bias, layer, "qkv", adapters, gather=sp)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)  # one gradient concat, not three
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:  # Qwen3: RMSNorm of each head before the rotation
            q = ops.rms_norm(q, layer.q_norm, self.eps)
            k = ops.rms_norm(k, layer.k_norm, self.eps)
        q = ops.rotary(q, cos, sin)
        k = ops.rotary(k, cos, sin)
        o = varlen_causal_attention(q, k, v, cu_seq_lens, max_seq_len, self.scale, window=layer.window, keys=keys)
        o = o.reshape(T, self.q_size)
        # under TP the row-parallel partial outputs (o, down) stay float32 until their all-reduce, then
        # round once, as the engine's (engine/models/llama.py) and the one-GPU product's
        attn_out = self._linear(o, layer.o, layer.o_bias, layer, "o", adapters, out_dtype=self.partial_dtype,
                                scatter=sp)
        if tp is not None and not sp:
            attn_out = tp.reduce_from(attn_out).to(x.dtype)
        x = x + attn_out
        h = ops.rms_norm(x, layer.post_norm, self.eps)
        if tp is not None and not sp:
            h = tp.copy_to(h)
        gate_up = self._linear(h, layer.gate_up, layer.gate_up_bias, layer, "gate_up", adapters, gather=sp)
        act = ops.silu_and_mul(gate_up)
        # the layer's output is not needed when recomputing it for the backward: skip the down GEMM
        # (and its all-reduce: every rank recomputes alike)
        with self._act_from_gate_up(act, gate_up) if keeps_activations else contextlib.nullcontext():
            down = self._linear(act, layer.down, layer.down_bias, layer, "down", adapters, skip_output=recomputing,
                                out_dtype=self.partial_dtype, scatter=sp)
        return x + (tp.reduce_from(down) if tp is not None and not sp and not recomputing else down).to(x.dtype)

    def _act_from_gate_up(self, act: torch.Tensor, gate_up: torch.Tensor) -> contextlib.AbstractContextManager:
        """While down's product records its backward: keep SwiGLU's output `act` [T, I] as the
        recipe silu_and_mul(gate_up) instead, and recompute it when the backward reads it. The
        SwiGLU's own backward keeps `gate_up` anyway, so a layer whose activations are kept
        (no recomputation) holds I model-dtype values per token less. A no-op where nothing is
        recorded, and during a CUDA graph capture."""
        if gate_up.is_cuda and torch.cuda.is_current_stream_capturing():
            return contextlib.nullcontext()
        silu_and_mul = self.ops.silu_and_mul

        def pack(t: torch.Tensor) -> Any:
            if t.data_ptr() == act.data_ptr() and t.shape == act.shape and t.dtype == act.dtype:
                return _Recipe(gate_up)
            return t

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, _Recipe):
                with torch.no_grad():
                    return silu_and_mul(saved.gate_up)
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: _Layer, name: str,
                adapters: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, skip_output: bool = False,
                out_dtype: torch.dtype | None = None, gather: bool = False, scatter: bool = False) -> torch.Tensor:
        """x W^T + b plus the group's LoRA deltas: [T, in] → [T, out] (in `out_dtype`, default x's).

        Sequence parallel: `gather` (q/k/v, gate/up) takes this rank's [T / P, in] rows and gathers
        them first; `scatter` (o, down) returns this rank's [T / P, out] rows of the summed output,
        rounded to x's dtype."""
        tp = self.tp
        if gather and (name not in adapters or layer.lora[name].dropout > 0):
            x, gather = tp.gather_tokens(x), False  # a frozen product, or a LoRA with dropout: the rows first
        if name not in adapters:
            if out_dtype is not None and out_dtype != x.dtype:
                y = _FrozenLinearF32.apply(x, weight, bias)
                return tp.scatter_tokens(y, x.dtype) if scatter else y.to(out_dtype)
            return F.linear(x, weight, bias)
        A, B, scales = adapters[name]
        lora = layer.lora[name]
        x_lora = x if lora.dropout == 0 else F.dropout(x, lora.dropout)  # this forward always trains
        return lora_linear(x, weight, bias, A, B, scales, x_lora, skip_output=skip_output, out_dtype=out_dtype,
                           tp=tp if name in ("o", "down") else None, gather=tp.group if gather else None,
                           scatter=tp.group if scatter else None)


class _FrozenLinearF32(torch.autograd.Function):
    """x W^T + b with a frozen W and b, accumulated and returned in float32 (modeling/precision.py);
    the input gradient in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return linear_f32(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        (weight,) = ctx.saved_tensors
        return grad_y.to(weight.dtype) @ weight, None, None


@dataclass(slots=True)
class _Recipe:
    """A saved SwiGLU output kept as its input (PackedDecoder._act_from_gate_up)."""

    gate_up: torch.Tensor


class _Recomputable:
    """A layer as `checkpoint` calls it: the first call is the forward pass, a later one the
    recomputation for the backward pass, which needs the layer's saved tensors but not its output."""

    def __init__(self, layer_fn: Any) -> None:
        self.layer_fn = layer_fn
        self.num_calls = 0

    def __call__(self, *args: Any) -> torch.Tensor:
        recomputing = self.num_calls > 0
        self.num_calls += 1
        return self.layer_fn(*args, recomputing=recomputing)


def _sliding_window(config: Any, layer: int) -> int | None:
    """Layer `layer`'s attention window, as transformers' modeling code reads it from the config."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and layer_types[layer] != "sliding_attention"):
        return None
    return window  # Mistral (no layer types: every layer), or a Qwen2/Qwen3 sliding layer
