"""The Llama family as a flat-batch decoder over a paged KV cache.

Covers LlamaForCausalLM (Llama 2/3.x, SmolLM2), MistralForCausalLM, Qwen2ForCausalLM (biased
q/k/v) and Qwen3ForCausalLM (RMSNorm on each head's q and k). The forward takes one flat batch of
tokens from many sequences (no padding) with their positions and a StepContext, like
nano-vllm; it reads the Hugging Face model's own weight tensors, fused q/k/v and gate/up.

References: Llama (Touvron et al. 2023, arXiv 2302.13971), GQA (Ainslie et al. 2023,
arXiv 2305.13245), SwiGLU (Shazeer 2020, arXiv 2002.05202), Qwen3 technical report (arXiv 2505.09388).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...modeling import SUPPORTED_ARCHITECTURES
from ...modeling.weights import base_layer, extend_linear, full_rows, fuse_linears
from ..context import StepContext
from ..layers import RotaryTable, ops_for, paged_attention
from ..lora import (
    EngineAdapter,
    LoRASegment,
    SpareRows,
    add_rms_norm_with_lora,
    linear_with_lora,
    linear_with_segments,
    lora_silu_and_mul,
    rotary_and_store_with_lora,
    silu_and_mul_with_lora,
    triton_lora,
)

if TYPE_CHECKING:
    from ...modeling.tensor_parallel import TensorParallel

__all__ = ["LlamaFamilyModel", "SUPPORTED_ARCHITECTURES"]



@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


class LlamaFamilyModel:
    """A decoder bound to `hf_model`'s weights (no copy; q/k/v and gate/up become fused views).

    Args:
        hf_model: a loaded `*ForCausalLM` of a supported architecture.
        max_positions: longest position the rotary table covers.
        max_lora_rank: spare weight rows per LoRA slice for the live adapter's A (engine/lora.py);
            adapters of a larger rank take the slower two-kernel path.
        spare_rows: allocate them (default: on CUDA with Triton, where they pay off; elsewhere
            the same math runs through PyTorch, which tests use).
        batch_invariant: every token computed the same whatever its batch (EngineConfig.batch_invariant):
            batch-invariant products and attention, no spare rows (their path and the shrink/expand
            path of a mixed batch round alike but sum differently).
        tp: this rank's tensor-parallel group, when `hf_model` holds its shards (modeling/tensor_parallel.py):
            the forward then runs this rank's heads and MLP columns, and sums o's and down's
            partial outputs (with their partial LoRA deltas) over the group, one all-reduce each.
            None: the whole model (no collective, nothing else changes).

    Raises:
        ConfigError: if `tp` is given but the weights are not this rank's shards.
    """

    def __init__(self, hf_model: Any, max_positions: int, *, max_lora_rank: int = 16,
                 spare_rows: bool | None = None, batch_invariant: bool = False,
                 tp: TensorParallel | None = None) -> None:
        config = hf_model.config
        inner = hf_model.model
        self.hf_layers = list(inner.layers)
        self.tp = tp if tp is not None and tp.size > 1 else None
        # a row-parallel layer's partial output under TP: float32, all-reduced, then rounded once, as the
        # one-GPU product rounds its whole sum once (the trainer's decoder does the same). Its LoRA delta:
        # on the spare rows' path x A^T is summed in the same all-reduce and the delta added after it, on
        # every rank (engine/lora.linear_with_lora); otherwise x A^T is summed first and the delta added
        # to the leader's partial output (engine/lora.row_parallel_delta)
        self.partial_dtype = torch.float32 if self.tp is not None else None
        tp_size = self.tp.size if self.tp is not None else 1
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // tp_size
        # decode attention splits each row's keys by the whole model's KV heads: a head's sums as on one GPU
        self.split_kv_heads = self.num_kv_heads * tp_size if self.tp is not None else None
        q_rows = base_layer(self.hf_layers[0].self_attn.q_proj).weight.shape[0]
        if q_rows != self.num_heads * self.head_dim:
            raise ConfigError(f"q_proj has {q_rows} rows but {self.num_heads} heads of {self.head_dim} need "
                              f"{self.num_heads * self.head_dim} at tensor_parallel_size {tp_size}: shard the model "
                              "with modeling.tensor_parallel.shard_llama_ for exactly the group passed as tp")
        self.hidden_size = config.hidden_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight  # [V, H], the embedding itself when tied
        self.rotary = RotaryTable(inner.rotary_emb, max_positions, self.dtype, self.device)
        self.batch_invariant = batch_invariant
        self.ops = ops_for(self.device, batch_invariant=batch_invariant)
        self.layers: list[_Layer] = []
        self.fused_slices: dict[str, dict[str, slice]] = {}
        if spare_rows is None:
            spare_rows = self.device.type == "cuda" and triton_lora is not None and not batch_invariant
        spare = max_lora_rank if spare_rows else 0

        def extra(parts: list) -> int:  # spare rows after the output rows of these fused projections
            return SpareRows.allocation(len(parts), spare, sum(m.out_features for m in parts)) if spare else 0

        for layer in self.hf_layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_parts = [base_layer(attn.q_proj), base_layer(attn.k_proj), base_layer(attn.v_proj)]
            gate_up_parts = [base_layer(mlp.gate_proj), base_layer(mlp.up_proj)]
            o_proj, down_proj = base_layer(attn.o_proj), base_layer(mlp.down_proj)
            qkv, qkv_bias, qkv_slices = fuse_linears(qkv_parts, ["q_proj", "k_proj", "v_proj"], extra_rows=extra(qkv_parts))
            gate_up, _, gate_up_slices = fuse_linears(gate_up_parts, ["gate_proj", "up_proj"], extra_rows=extra(gate_up_parts))
            o = extend_linear(o_proj, extra([o_proj]))[0] if spare else o_proj.weight
            down = extend_linear(down_proj, extra([down_proj]))[0] if spare else down_proj.weight
            self.fused_slices = {"qkv": qkv_slices, "gate_up": gate_up_slices}
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=q_norm.weight if q_norm is not None else None,
                k_norm=k_norm.weight if k_norm is not None else None,
                o=o,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=gate_up,
                down=down,
            ))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate_size = self.layers[0].gate_up.shape[0] // 2
        self.spare_rows = None
        if spare:
            full = [{"qkv": full_rows(lay.qkv), "o": full_rows(lay.o), "gate_up": full_rows(lay.gate_up),
                     "down": full_rows(lay.down)} for lay in self.layers]
            num_out = {"qkv": self.layers[0].qkv.shape[0], "o": self.hidden_size,
                       "gate_up": 2 * self.intermediate_size, "down": self.hidden_size}
            self.spare_rows = SpareRows(full, num_out, spare)

    def bind_lora(self, lora: list[LoRASegment], num_rows: int) -> bool:
        """Put the adapter of a batch whose `num_rows` rows all use one adapter into the spare rows.

        Returns whether the forward will take the spare-rows path for this batch (call it before
        every forward or graph replay with an adapter: it refreshes the copy of A when needed).
        """
        if self.spare_rows is None or len(lora) != 1 or lora[0].start != 0 or lora[0].end != num_rows:
            return False
        return lora[0].adapter is not None and self.spare_rows.bind(lora[0].adapter)

    def _bound(self, lora: list[LoRASegment], num_rows: int) -> EngineAdapter | None:
        if self.spare_rows is None or len(lora) != 1 or lora[0].start != 0 or lora[0].end != num_rows:
            return None
        return lora[0].adapter if lora[0].adapter is self.spare_rows.bound else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def partial_width(self) -> int:
        """Columns of the widest row-parallel output a decode step all-reduces (o's or down's,
        with their spare rows' x A^T)."""
        layer = self.layers[0]
        return max(full_rows(layer.o).shape[0], full_rows(layer.down).shape[0])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: StepContext,
        kv_cache: torch.Tensor,
        lora: list[LoRASegment],
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: [N] token ids of the flat batch.
            positions: [N] their positions in their sequences.
            ctx: attention metadata.
            kv_cache: [layers, 2, num_blocks, block_size, Hkv, D].
            lora: adapter segments of the batch's rows (empty: base weights only).

        Returns:
            [N, H].
        """
        N = input_ids.shape[0]
        ops, tp = self.ops, self.tp
        x = F.embedding(input_ids, self.embed)  # [N, H]
        residual = None
        cos, sin = self.rotary(positions)  # [N, D] each
        bound = self._bound(lora, N)  # the whole batch uses the adapter held by the spare rows
        if bound is not None:
            return self._forward_spare_rows(x, cos, sin, ctx, kv_cache, bound)
        for i, layer in enumerate(self.layers):
            if residual is None:
                h, residual = ops.rms_norm(x, layer.input_norm, self.eps), x
            else:  # the previous layer's MLP output joins the residual stream here
                h, residual = ops.add_rms_norm(x, residual, layer.input_norm, self.eps)
            qkv = linear_with_segments(h, layer.qkv, layer.qkv_bias, lora, i, "qkv", ops)  # [N, (Hq + 2Hkv) D]
            q = qkv[:, : self.q_size].view(N, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(N, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(N, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None:  # Qwen3: RMSNorm of each head before the rotation
                q = ops.rms_norm(q, layer.q_norm, self.eps)
                k = ops.rms_norm(k, layer.k_norm, self.eps)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            ops.rotary_and_store_(q, k, v, cos, sin, k_cache, v_cache, ctx.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, ctx, self.scale, batch_invariant=self.batch_invariant,
                                split_kv_heads=self.split_kv_heads).reshape(N, self.q_size)  # [N, Hq D]
            attn_out = linear_with_segments(o, layer.o, None, lora, i, "o", ops, out_dtype=self.partial_dtype,
                                            tp=tp)
            attn_out = self._sum_partials(attn_out)
            h, residual = ops.add_rms_norm(attn_out, residual, layer.post_norm, self.eps)
            act = lora_silu_and_mul(h, layer.gate_up, lora, i, ops)  # [N, I / P]
            x = linear_with_segments(act, layer.down, None, lora, i, "down", ops, out_dtype=self.partial_dtype,
                                     tp=tp)
            x = self._sum_partials(x)
        return ops.add_rms_norm(x, residual, self.norm, self.eps)[0]

    def _forward_spare_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext,
                            kv_cache: torch.Tensor, adapter: EngineAdapter) -> torch.Tensor:
        """`forward` for a batch that uses the adapter bound to the spare rows (x A^T from the base GEMMs).

        The q/k/v, o and down deltas are left to the kernels that read those outputs next
        (engine/lora.py); Qwen3's q/k norm, which sits between q/k/v and the rotation, keeps the
        q/k/v expand. With tensor parallelism o's and down's GEMM outputs (each rank's partial
        x W^T beside its partial x A^T) are summed over the ranks in one all-reduce each, and the
        deltas are then added as on one GPU, by the kernels that read those outputs next.
        """
        N = x.shape[0]
        ops, tp = self.ops, self.tp
        residual, deferred = None, None
        for i, layer in enumerate(self.layers):
            groups = adapter.layers[i]
            if residual is None:
                h, residual = ops.rms_norm(x, layer.input_norm, self.eps), x
            else:  # with the previous layer's down delta, if deferred
                h, residual = add_rms_norm_with_lora(x, deferred, residual, layer.input_norm, self.eps, ops.add_rms_norm)
            qkv, deferred = linear_with_lora(h, full_rows(layer.qkv), full_rows(layer.qkv_bias), layer.qkv.shape[0],
                                             groups["qkv"], defer=layer.q_norm is None)
            q = qkv[:, : self.q_size].view(N, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(N, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(N, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, self.eps)
                k = ops.rms_norm(k, layer.k_norm, self.eps)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            q = rotary_and_store_with_lora(q, k, v, cos, sin, k_cache, v_cache, ctx.slot_mapping, deferred, qkv,
                                           ops.rotary_and_store_)
            o = paged_attention(q, k_cache, v_cache, ctx, self.scale,
                                split_kv_heads=self.split_kv_heads).reshape(N, self.q_size)
            attn_out, deferred = linear_with_lora(o, full_rows(layer.o), None, self.hidden_size, groups["o"],
                                                  defer=True, out_dtype=self.partial_dtype, tp=tp)
            if deferred is None:  # without o's LoRA: the partial outputs summed and rounded here
                attn_out = self._sum_partials(attn_out)
            h, residual = add_rms_norm_with_lora(attn_out, deferred, residual, layer.post_norm, self.eps, ops.add_rms_norm)
            act = silu_and_mul_with_lora(h, full_rows(layer.gate_up), 2 * self.intermediate_size, groups["gate_up"],
                                         ops.silu_and_mul)
            x, deferred = linear_with_lora(act, full_rows(layer.down), None, self.hidden_size, groups["down"],
                                           defer=True, out_dtype=self.partial_dtype, tp=tp)
            if deferred is None:
                x = self._sum_partials(x)
        return add_rms_norm_with_lora(x, deferred, residual, self.norm, self.eps, ops.add_rms_norm)[0]

    def _sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: under TP this rank's float32 partial sum (its heads' or MLP
        columns' share, LoRA delta included on the leader) summed over the ranks and rounded once to
        the model dtype; without TP, x itself."""
        if self.tp is None:
            return x
        return self.tp.all_reduce(x).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] → [S, V] float32 logits, unrounded (modeling/precision.py): the trainer's, bit for bit
        in the products and accumulation."""
        return self.ops.linear_f32(hidden, self.lm_head)
