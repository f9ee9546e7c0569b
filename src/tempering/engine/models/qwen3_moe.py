"""Qwen3-MoE (`Qwen3MoeForCausalLM`) as a flat-batch decoder over a paged KV cache.

The attention is Qwen3's (fused q/k/v, RMSNorm on each head's q and k, rotary, paged attention,
LoRA on q/k/v and o), with the same building blocks as the Llama family (llama.py). The MLP of
most layers is a sparse MoE block (modeling/experts.py): router softmax, top-k experts with
renormalized weights, the experts' SwiGLU as grouped GEMMs over the tokens sorted by expert
(`torch._grouped_mm`; a loop over experts where torch lacks it), and the live adapter's rank-r LoRA
on each expert's gate/up and down (on a GPU two Triton kernels each, layers/triton_moe_lora.py; on
the CPU two more grouped GEMMs, as the trainer computes it). Layers named in
`mlp_only_layers` (or off `decoder_sparse_step`) keep a dense SwiGLU MLP.

Each forward records every token's experts per MoE layer at its KV slot (engine/routing.py),
so a finished sample can return the routing it was sampled with (routing replay).

In batch-invariant mode (exact on-policy) the attention and dense layers take the Llama family's
invariant kernels, the router and the experts' products the invariant matmul and grouped matmul
(layers/triton_matmul.py), and the k expert outputs are summed one by one in float32: a token's
experts and output never depend on its batch, so rescoring a sample gives its sampled values.

The live adapter's expert LoRA is read from PEFT's tensors: a copy of A and B stacked per expert
in the model dtype is refreshed whenever the trainer changed them (PyTorch's version counters
tell), in `bind_lora`, which the runner calls before every forward or graph replay with an
adapter; captured CUDA graphs read those copies in place.

References: Qwen3 technical report (arXiv 2505.09388); sparsely-gated MoE (Shazeer et al. 2017,
arXiv 1701.06538); rollout routing replay (arXiv 2510.11370).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ...modeling.experts import MoEDelta, collect_expert_lora, experts_of, is_moe_layer, routing_dtype, sparse_moe
from ...modeling.weights import base_layer, fuse_linears
from ..context import StepContext
from ..layers import RotaryTable, ops_for, paged_attention
from ..lora import EngineAdapter, LoRASegment, linear_with_segments, lora_silu_and_mul
from ..routing import RoutingTable

__all__ = ["Qwen3MoeModel"]

_NO_MLP = SimpleNamespace(gate_proj=None, up_proj=None, down_proj=None)  # collect_adapter finds no LoRA on it


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    moe: Any  # the sparse MoE block (PEFT may rewrap its experts), or None for a dense layer
    moe_index: int  # its row of the routing table (-1: dense)
    router: torch.Tensor | None  # [E, H]
    gate_up: torch.Tensor  # MoE: [E, 2I, H]; dense: [2I, H]
    down: torch.Tensor  # MoE: [E, H, I]; dense: [H, I]


class _ExpertShadows:
    """An adapter's expert LoRA stacked per expert in the model dtype, refreshed from PEFT's tensors."""

    def __init__(self, layers: list[Any], adapter: str, dtype: torch.dtype) -> None:
        self.loras = [collect_expert_lora(block.experts, adapter) if block is not None else {} for block in layers]
        self.dtype = dtype
        self.deltas: list[MoEDelta | None] = []
        for found in self.loras:
            if not found:
                self.deltas.append(None)
                continue
            with torch.no_grad():
                pair = {name: found[name].stacked(dtype) for name in found}
            self.deltas.append(MoEDelta(pair.get("gate_up_proj"), pair.get("down_proj")))
        self.sources = [t for found in self.loras for lora in found.values() for t in (lora.A, lora.B)]
        self._version = self._current()

    def _current(self) -> int:
        return sum(t._version for t in self.sources)

    def refresh(self) -> None:
        """Copy PEFT's A and B again if any changed in place since the last copy."""
        version = self._current()
        if version == self._version:
            return
        with torch.no_grad():
            for found, delta in zip(self.loras, self.deltas):
                for name, lora in found.items():
                    A, B = lora.stacked(self.dtype)
                    dst = delta.gate_up if name == "gate_up_proj" else delta.down
                    dst[0].copy_(A)
                    dst[1].copy_(B)
        self._version = version


class Qwen3MoeModel:
    """Qwen3-MoE bound to `hf_model`'s weights (no copy; q/k/v and dense gate/up become fused views).

    Args:
        hf_model: a loaded `Qwen3MoeForCausalLM`.
        max_positions: longest position the rotary table covers.
        max_lora_rank: unused (no spare-rows LoRA path for this model yet); kept for the same signature.
        batch_invariant: every token computed the same whatever its batch (EngineConfig.batch_invariant).
    """

    def __init__(self, hf_model: Any, max_positions: int, *, max_lora_rank: int = 16,
                 batch_invariant: bool = False) -> None:
        config = hf_model.config
        inner = hf_model.model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.normalize = bool(config.norm_topk_prob)
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.rotary = RotaryTable(inner.rotary_emb, max_positions, self.dtype, self.device)
        self.batch_invariant = batch_invariant
        self.ops = ops_for(self.device, batch_invariant=batch_invariant)
        self.moe_kernels: dict[str, Any] = {}  # sparse_moe's products in batch-invariant mode (CUDA)
        if self.ops.batch_invariant:
            from ..layers.triton_matmul import grouped_matmul

            self.moe_kernels = {"linear": self.ops.linear, "fixed_order_sum": True,
                                "grouped": lambda x, weight, batch: grouped_matmul(x, weight, batch.offsets)}
        self.add_expert_delta = None  # the expert LoRA's delta: two grouped GEMMs (modeling/experts.py)
        if self.device.type == "cuda":  # or per-expert Triton kernels, ~20x faster at decode sizes
            from ..layers.triton_moe_lora import moe_lora_add_

            self.add_expert_delta = moe_lora_add_
        self.spare_rows = None  # the Llama family's spare-rows LoRA path is not implemented here
        self.layers: list[_Layer] = []
        self.hf_layers = []  # what collect_adapter reads: attention, and the dense MLPs only
        gate_up_slices = None
        num_moe = 0
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_parts = [base_layer(attn.q_proj), base_layer(attn.k_proj), base_layer(attn.v_proj)]
            qkv, qkv_bias, qkv_slices = fuse_linears(qkv_parts, ["q_proj", "k_proj", "v_proj"])
            if is_moe_layer(config, i):
                experts = experts_of(mlp)
                moe, moe_index, router = mlp, num_moe, mlp.gate.weight
                gate_up, down = experts.gate_up_proj, experts.down_proj
                num_moe += 1
                self.hf_layers.append(SimpleNamespace(self_attn=attn, mlp=_NO_MLP))
            else:
                gate_up, _, gate_up_slices = fuse_linears([base_layer(mlp.gate_proj), base_layer(mlp.up_proj)],
                                                          ["gate_proj", "up_proj"])
                moe, moe_index, router, down = None, -1, None, base_layer(mlp.down_proj).weight
                self.hf_layers.append(layer)
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=qkv_bias, q_norm=attn.q_norm.weight,
                k_norm=attn.k_norm.weight, o=base_layer(attn.o_proj).weight,
                post_norm=layer.post_attention_layernorm.weight, moe=moe, moe_index=moe_index, router=router,
                gate_up=gate_up, down=down,
            ))
        I = config.intermediate_size
        self.fused_slices = {"qkv": qkv_slices,
                             "gate_up": gate_up_slices or {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I)}}
        self.num_moe_layers = num_moe
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.routing: RoutingTable | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def routing_bytes_per_token(self) -> int:
        """Bytes the routing table takes per KV slot."""
        return RoutingTable.bytes_per_token(self.num_moe_layers, self.top_k, routing_dtype(self.num_experts))

    def allocate_routing(self, num_slots: int) -> RoutingTable:
        """The routing table for a KV cache of `num_slots` slots, which every forward then writes."""
        self.routing = RoutingTable(self.num_moe_layers, num_slots, self.top_k, routing_dtype(self.num_experts),
                                    self.device)
        return self.routing

    # ---- the live adapter's expert LoRA ---------------------------------------------------------

    def _shadows(self, adapter: EngineAdapter) -> _ExpertShadows:
        shadows = getattr(adapter, "expert_shadows", None)
        if shadows is None:  # kept with the adapter: graphs captured for it read these tensors
            shadows = _ExpertShadows([lay.moe for lay in self.layers], adapter.name, self.dtype)
            adapter.expert_shadows = shadows
        return shadows

    def bind_lora(self, lora: list[LoRASegment], num_rows: int) -> bool:
        """Refresh the expert LoRA copies of the batch's adapters (before every forward or graph
        replay with an adapter). Returns False: no spare-rows path."""
        for seg in lora:
            if seg.adapter is not None:
                self._shadows(seg.adapter).refresh()
        return False

    def _deltas(self, lora: list[LoRASegment], N: int, device: torch.device) -> list[list[MoEDelta]]:
        """Per layer, the expert LoRA of each adapter of the batch, with its rows when it is not every row's."""
        by_adapter: dict[int, tuple[EngineAdapter, list[LoRASegment]]] = {}
        for seg in lora:
            if seg.adapter is not None:
                by_adapter.setdefault(id(seg.adapter), (seg.adapter, []))[1].append(seg)
        per_layer: list[list[MoEDelta]] = [[] for _ in self.layers]
        for adapter, segs in by_adapter.values():
            rows = None
            if not (len(segs) == 1 and segs[0].start == 0 and segs[0].end == N):
                rows = torch.zeros(N, dtype=torch.bool)
                for s in segs:
                    rows[s.start:s.end] = True
                rows = rows.to(device)
            for i, d in enumerate(self._shadows(adapter).deltas):
                if d is not None:
                    per_layer[i].append(MoEDelta(d.gate_up, d.down, rows))
        return per_layer

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor,
                lora: list[LoRASegment]) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: [N] token ids of the flat batch.
            positions: [N] their positions in their sequences.
            ctx: attention metadata.
            kv_cache: [layers, 2, num_blocks, block_size, Hkv, D].
            lora: adapter segments of the batch's rows (empty: base weights only).

        Returns:
            [N, H]. Also writes each token's experts to the routing table at its slot. Tokens route to
            `ctx.routing_replay`'s experts where it gives them.
        """
        N = input_ids.shape[0]
        ops = self.ops
        x = F.embedding(input_ids, self.embed)  # [N, H]
        residual = None
        cos, sin = self.rotary(positions)  # [N, D] each
        deltas = self._deltas(lora, N, x.device) if lora else None
        replay = ctx.routing_replay  # scoring sampled sequences with their routing (Engine.score)
        for i, layer in enumerate(self.layers):
            if residual is None:
                h, residual = ops.rms_norm(x, layer.input_norm, self.eps), x
            else:
                h, residual = ops.add_rms_norm(x, residual, layer.input_norm, self.eps)
            qkv = linear_with_segments(h, layer.qkv, layer.qkv_bias, lora, i, "qkv", ops)  # [N, (Hq + 2Hkv) D]
            q = qkv[:, : self.q_size].view(N, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(N, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(N, self.num_kv_heads, self.head_dim)
            q = ops.rms_norm(q, layer.q_norm, self.eps)
            k = ops.rms_norm(k, layer.k_norm, self.eps)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            ops.rotary_and_store_(q, k, v, cos, sin, k_cache, v_cache, ctx.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, ctx, self.scale,
                                batch_invariant=self.batch_invariant).reshape(N, self.q_size)  # [N, Hq D]
            attn_out = linear_with_segments(o, layer.o, None, lora, i, "o", ops)
            h, residual = ops.add_rms_norm(attn_out, residual, layer.post_norm, self.eps)
            if layer.moe is not None:
                x, ids = sparse_moe(h, layer.router, layer.gate_up, layer.down, top_k=self.top_k,
                                    normalize=self.normalize, silu_and_mul=ops.silu_and_mul,
                                    deltas=deltas[i] if deltas else (), add_delta=self.add_expert_delta,
                                    replay=replay[:, layer.moe_index] if replay is not None else None,
                                    **self.moe_kernels)
                if self.routing is not None:
                    self.routing.write(layer.moe_index, ctx.slot_mapping, ids)
                continue
            act = lora_silu_and_mul(h, layer.gate_up, lora, i, ops)  # [N, I]
            x = linear_with_segments(act, layer.down, None, lora, i, "down", ops)
        return ops.add_rms_norm(x, residual, self.norm, self.eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] → [S, V] float32 logits, unrounded (modeling/precision.py; batch-invariant in that mode)."""
        return self.ops.linear_f32(hidden, self.lm_head)
