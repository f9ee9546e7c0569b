"""The trainer's own forward for Qwen3-MoE: packed rows, fused attention LoRA, grouped experts, routing replay.

Attention is the Llama family's (decoder.py: fused q/k/v with their LoRAs in one GEMM, q/k norm,
rotary, varlen attention over the packed row). A sparse MoE block runs modeling/experts.py's
`sparse_moe`: the router's softmax and top-k, the tokens sorted by expert, each expert
projection as one grouped GEMM (`torch._grouped_mm`; a loop over experts where torch lacks it)
and each expert's LoRA (PEFT `target_parameters`, rank r per expert) as two more; no tensor is
[tokens, experts, hidden]. Layers are recomputed in the backward pass when checkpointing.

Routing replay: given `routed_experts` [T, L_moe, k] (the experts the engine routed each token
to when it sampled, -1 where unknown), each MoE layer uses those experts instead of its own
top-k, weighted by its own router probabilities (renormalized over the k as the model does).
The logprobs the trainer computes are then those of the function the engine sampled from, up to
floating-point differences, instead of one whose routing flipped wherever two experts' router
scores were within rounding of each other (R3, Ma et al. 2025, arXiv 2510.11370). The router
itself is not trained (LoRA targets the projections), so replay changes no gradient path.

LoRA targets: ART's `target_modules` (q/k/v/o_proj, gate_proj, up_proj, down_proj). On
transformers 5 the experts are stacked parameters, and PEFT (0.21) turns gate_proj + up_proj
into one LoRA on `experts.gate_up_proj` of rank 2r (alpha 2·alpha: the same scale) and down_proj
into one on `experts.down_proj` of rank r, each expert with its own A and B (`ParamWrapper`).
`expert_target_modules` keeps those names in the list PEFT gets although no module carries them.
(PEFT moves those names to the experts altogether: the dense MLP of a layer in `mlp_only_layers`
then gets no LoRA. Qwen3-30B-A3B has none; the forward below covers such layers either way.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..modeling import MOE_ARCHITECTURES, covered_architecture
from ..modeling.experts import ExpertLoRA, MoEDelta, collect_expert_lora, experts_of, is_moe_layer, sparse_moe
from ..modeling.lora import collect_adapter
from ..modeling.weights import base_layer, fuse_linears
from .attention import varlen_causal_attention
from .decoder import PackedDecoder, _dropout_p, _group, _GroupLoRA, _Recomputable, _sliding_window
from .kernels import ops_for

__all__ = ["MoEPackedDecoder", "expert_modules_of", "expert_target_modules"]

log = logging.getLogger("tempering")

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_target_modules(model: Any, target_modules: list[str]) -> list[str]:
    """The target modules naming expert projections that a model stores as stacked parameters
    (PEFT maps them onto those parameters); empty for a dense model."""
    has_stacked = any(isinstance(w := getattr(m, "gate_up_proj", None), torch.Tensor) and w.dim() == 3
                      for m in model.modules())  # (Phi-3's gate_up_proj is an nn.Linear)
    return [m for m in target_modules if m in EXPERT_PROJECTIONS] if has_stacked else []


def expert_modules_of(target_parameters: Any) -> list[str]:
    """The target modules a PEFT adapter's `target_parameters` on stacked experts stand for."""
    names = {str(p).rsplit(".", 1)[-1] for p in (target_parameters or ())}
    return ["gate_proj", "up_proj"] * ("gate_up_proj" in names) + ["down_proj"] * ("down_proj" in names)


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    lora: dict[str, _GroupLoRA]  # "qkv", "o" and, in a dense layer, "gate_up", "down"
    window: int | None
    moe_index: int  # -1: a dense layer
    router: torch.Tensor | None  # [E, H]
    gate_up: torch.Tensor  # MoE: [E, 2I, H]; dense: [2I, H]
    down: torch.Tensor  # MoE: [E, H, I]; dense: [H, I]
    experts: dict[str, ExpertLoRA]  # "gate_up_proj", "down_proj": PEFT's expert LoRA

    @property
    def out_features(self) -> dict[str, int]:
        out = {"qkv": self.qkv.shape[0], "o": self.o.shape[0]}
        if self.moe_index < 0:
            out |= {"gate_up": self.gate_up.shape[0], "down": self.down.shape[0]}
        return out


class MoEPackedDecoder(PackedDecoder):
    """Final hidden states [T, H] of one packed row of a Qwen3-MoE model, differentiable in the LoRA parameters.

    Build it with `MoEPackedDecoder.maybe(peft_model, adapter)` (None for other architectures).
    """

    def __init__(self, peft_model: Any, adapter: str) -> None:  # noqa: D107 (PackedDecoder's attributes, MoE layers)
        hf = peft_model.get_base_model()
        config = hf.config
        inner = hf.model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.top_k = config.num_experts_per_tok
        self.normalize = bool(config.norm_topk_prob)
        self.embed = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.final_norm = inner.norm.weight
        hf_layers = list(inner.layers)
        I = config.intermediate_size
        slices: dict[str, dict[str, slice]] = {"gate_up": {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I)}}
        views, fused = [], []
        for i, layer in enumerate(hf_layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_parts = [base_layer(attn.q_proj), base_layer(attn.k_proj), base_layer(attn.v_proj)]
            qkv, qkv_bias, slices["qkv"] = fuse_linears(qkv_parts, ["q_proj", "k_proj", "v_proj"])
            if is_moe_layer(config, i):
                fused.append((qkv, qkv_bias, None, None))
                views.append(_AttentionOnly(attn))
            else:
                gate_up, gate_up_bias, slices["gate_up"] = fuse_linears(
                    [base_layer(mlp.gate_proj), base_layer(mlp.up_proj)], ["gate_proj", "up_proj"])
                fused.append((qkv, qkv_bias, gate_up, gate_up_bias))
                views.append(layer)
        adapter_weights = collect_adapter(views, adapter, slices)
        self.layers: list[_Layer] = []
        num_moe = 0
        for i, (layer, (qkv, qkv_bias, gate_up, _), groups) in enumerate(zip(hf_layers, fused, adapter_weights.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            modules = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj]}
            if gate_up is not None:
                modules |= {"gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
            lora = {}
            for name, entries in groups.items():
                group = _group(entries, [_dropout_p(m, adapter) for m in modules.get(name, [])])
                if group is not None:
                    lora[name] = group
            o_proj = base_layer(attn.o_proj)
            if gate_up is None:  # a sparse MoE block
                experts = experts_of(mlp)
                moe = dict(moe_index=num_moe, router=mlp.gate.weight, gate_up=experts.gate_up_proj,
                           down=experts.down_proj, experts=collect_expert_lora(mlp.experts, adapter))
                num_moe += 1
            else:
                down = base_layer(mlp.down_proj).weight
                moe = dict(moe_index=-1, router=None, gate_up=gate_up, down=down, experts={})
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight, qkv=qkv, qkv_bias=qkv_bias, q_norm=attn.q_norm.weight,
                k_norm=attn.k_norm.weight, o=o_proj.weight, o_bias=o_proj.bias,
                post_norm=layer.post_attention_layernorm.weight, lora=lora, window=_sliding_window(config, i), **moe,
            ))
        self.num_moe_layers = num_moe
        self.ops = ops_for(self.final_norm.device)
        self.has_dropout = any(g.dropout > 0 for layer in self.layers for g in layer.lora.values())

    @classmethod
    def maybe(cls, peft_model: Any, adapter: str) -> MoEPackedDecoder | None:
        """A decoder for `peft_model`, or None if its architecture or adapter is not covered."""
        hf = peft_model.get_base_model()
        if covered_architecture(hf, MOE_ARCHITECTURES) is None:
            return None
        if getattr(hf.config, "hidden_act", "silu") != "silu":
            return None
        if getattr(peft_model.peft_config[adapter], "use_dora", False):
            return None
        try:
            return cls(peft_model, adapter)
        except ValueError as exc:
            log.info("training with the transformers forward: %s", exc)
            return None

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seq_lens: torch.Tensor,
                 max_seq_len: int, *, keys: tuple[torch.Tensor, torch.Tensor, int] | None = None, lora: bool = True,
                 checkpointing: bool = False, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm (see PackedDecoder.__call__).

        Args:
            routed_experts: [T, L_moe, k] integer expert ids to route each token to in each MoE
                layer (routing replay; -1 rows route by themselves), or None.

        Returns:
            [T, H] in the model dtype.
        """
        x = F.embedding(input_ids, self.embed.weight)  # [T, H]
        cos, sin = self.rotary_emb(x, position_ids[None])
        cos, sin = cos[0], sin[0]
        recompute = checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            adapters = ({name: g.delta_inputs(x.dtype, layer.out_features[name]) for name, g in layer.lora.items()}
                        if lora else {})
            delta = None
            if lora and layer.experts:  # stacked per expert in the model dtype, once per forward
                pair = {name: e.stacked(x.dtype) for name, e in layer.experts.items()}
                delta = MoEDelta(pair.get("gate_up_proj"), pair.get("down_proj"))
            replay = routed_experts[:, layer.moe_index] if routed_experts is not None and layer.moe_index >= 0 else None
            args = (layer, x, cos, sin, cu_seq_lens, max_seq_len, adapters, keys, delta, replay)
            if recompute:
                x = checkpoint(_Recomputable(self._layer), *args, use_reentrant=False,
                               preserve_rng_state=self.has_dropout)
            else:
                x = self._layer(*args)
        return self.ops.rms_norm(x, self.final_norm, self.eps)

    def _layer(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seq_lens: torch.Tensor,
               max_seq_len: int, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
               keys: tuple[torch.Tensor, torch.Tensor, int] | None = None, delta: MoEDelta | None = None,
               replay: torch.Tensor | None = None, *, recomputing: bool = False) -> torch.Tensor:
        T = x.shape[0]
        ops = self.ops
        h = ops.rms_norm(x, layer.input_norm, self.eps)
        qkv = self._linear(h, layer.qkv, layer.qkv_bias, layer, "qkv", adapters)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        q = ops.rms_norm(q.view(T, self.num_heads, self.head_dim), layer.q_norm, self.eps)
        k = ops.rms_norm(k.view(T, self.num_kv_heads, self.head_dim), layer.k_norm, self.eps)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q = ops.rotary(q, cos, sin)
        k = ops.rotary(k, cos, sin)
        o = varlen_causal_attention(q, k, v, cu_seq_lens, max_seq_len, self.scale, window=layer.window, keys=keys)
        x = x + self._linear(o.reshape(T, self.q_size), layer.o, layer.o_bias, layer, "o", adapters)
        h = ops.rms_norm(x, layer.post_norm, self.eps)
        if layer.moe_index >= 0:
            out, _ = sparse_moe(h, layer.router, layer.gate_up, layer.down, top_k=self.top_k, normalize=self.normalize,
                                silu_and_mul=ops.silu_and_mul, deltas=[delta] if delta is not None else [], replay=replay)
            return x + out
        gate_up = self._linear(h, layer.gate_up, None, layer, "gate_up", adapters)
        act = ops.silu_and_mul(gate_up)
        return x + self._linear(act, layer.down, None, layer, "down", adapters, skip_output=recomputing)


class _AttentionOnly:
    """A decoder layer as collect_adapter sees it when its MLP is a sparse MoE block (whose expert
    LoRA is collected apart): the attention, and an MLP with no LoRA."""

    class _NoMLP:
        gate_proj = up_proj = down_proj = None

    def __init__(self, attn: Any) -> None:
        self.self_attn = attn
        self.mlp = self._NoMLP()
