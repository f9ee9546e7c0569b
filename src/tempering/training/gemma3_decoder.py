"""The trainer's own forward for Gemma 3: packed rows, fused LoRA, as decoder.py does for Llama.

The LoRA math (one GEMM for the base weight and every LoRA of a fused projection, the merged
weight in the backward pass), the varlen attention with sliding windows, layer recomputation and
the adapter's tensors (PEFT's own parameters) are the Llama family's (decoder.py); what differs
is the layer (engine/models/gemma3.py says how):

    x = x + post_attention_norm(o_proj(attention(rotary_t(q_norm(q)), rotary_t(k_norm(k)), v)))
    x = x + post_feedforward_norm(down(gelu_tanh(gate) * up))   of pre_feedforward_norm(x)

with the (1 + w) RMSNorm, the local or global rotary table of layer type t, the softmax scale
`query_pre_attn_scalar ** -0.5` and the embedding scaled by sqrt(hidden) (modeling/gemma.py).
Tests check logprobs and LoRA gradients against the PEFT-wrapped transformers model.

References: Gemma 3 technical report (arXiv 2503.19786); LoRA (Hu et al. 2021, arXiv 2106.09685).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..modeling import covered_architecture
from ..modeling.gemma import GEMMA3_ARCHITECTURES, embed_scale, gelu_and_mul, gemma_rms_norm, norm_gain, unsupported_reason
from ..modeling.lora import collect_adapter
from ..modeling.weights import base_layer, fuse_linears
from .attention import varlen_causal_attention
from .decoder import PackedDecoder, _dropout_p, _group, _GroupLoRA, _Recomputable, _sliding_window
from .kernels import ops_for

__all__ = ["Gemma3PackedDecoder"]

log = logging.getLogger("tempering")



@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [H] float32 gains (1 + w)
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o: torch.Tensor  # [H, Hq D]
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]
    post_feedforward_norm: torch.Tensor
    lora: dict[str, _GroupLoRA]
    layer_type: str  # which rotary table
    window: int | None  # sliding attention window

    @property
    def out_features(self) -> dict[str, int]:
        return {"qkv": self.qkv.shape[0], "o": self.o.shape[0], "gate_up": self.gate_up.shape[0],
                "down": self.down.shape[0]}


class Gemma3PackedDecoder(PackedDecoder):
    """Final hidden states [T, H] of one packed row of a Gemma 3 model, differentiable in the LoRA parameters.

    Build it with `Gemma3PackedDecoder.maybe(peft_model, adapter)` (None for other architectures
    and for Gemma configs it does not cover). Called as `PackedDecoder` is.
    """

    def __init__(self, peft_model: Any, adapter: str) -> None:  # PackedDecoder's __init__ is not called
        hf = peft_model.get_base_model()
        config = hf.config
        inner = hf.model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.embed = inner.embed_tokens
        self.embed_scale = embed_scale(config, inner.embed_tokens.weight.dtype, inner.embed_tokens.weight.device)
        self.rotary_emb = inner.rotary_emb
        self.final_norm = norm_gain(inner.norm)
        hf_layers = list(inner.layers)
        slices: dict[str, dict[str, slice]] = {}
        fused = []
        for layer in hf_layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, _, slices["qkv"] = fuse_linears(
                [base_layer(attn.q_proj), base_layer(attn.k_proj), base_layer(attn.v_proj)], ["q_proj", "k_proj", "v_proj"])
            gate_up, _, slices["gate_up"] = fuse_linears(
                [base_layer(mlp.gate_proj), base_layer(mlp.up_proj)], ["gate_proj", "up_proj"])
            fused.append((qkv, gate_up))
        adapter_weights = collect_adapter(hf_layers, adapter, slices)
        self.layers: list[_Layer] = []
        for i, (layer, (qkv, gate_up), groups) in enumerate(zip(hf_layers, fused, adapter_weights.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            modules = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
                       "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
            lora = {}
            for name, entries in groups.items():
                group = _group(entries, [_dropout_p(m, adapter) for m in modules[name]])
                if group is not None:
                    lora[name] = group
            self.layers.append(_Layer(
                input_norm=norm_gain(layer.input_layernorm), qkv=qkv,
                q_norm=norm_gain(attn.q_norm), k_norm=norm_gain(attn.k_norm), o=base_layer(attn.o_proj).weight,
                post_attention_norm=norm_gain(layer.post_attention_layernorm),
                pre_feedforward_norm=norm_gain(layer.pre_feedforward_layernorm), gate_up=gate_up,
                down=base_layer(mlp.down_proj).weight,
                post_feedforward_norm=norm_gain(layer.post_feedforward_layernorm),
                lora=lora, layer_type=config.layer_types[i], window=_sliding_window(config, i),
            ))
        self.ops = ops_for(self.final_norm.device)
        self.has_dropout = any(g.dropout > 0 for layer in self.layers for g in layer.lora.values())

    @classmethod
    def maybe(cls, peft_model: Any, adapter: str) -> Gemma3PackedDecoder | None:
        """A decoder for `peft_model`, or None if it is not a Gemma 3 model this code covers (logged)."""
        hf = peft_model.get_base_model()
        config = hf.config
        if covered_architecture(hf, GEMMA3_ARCHITECTURES) is None:
            return None
        reason = unsupported_reason(config)
        if reason is None and getattr(peft_model.peft_config[adapter], "use_dora", False):
            reason = "DoRA adapters are not supported"
        if reason is not None:
            log.info("training Gemma 3 with the transformers forward: %s", reason)
            return None
        return cls(peft_model, adapter)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seq_lens: torch.Tensor,
                 max_seq_len: int, *, keys: tuple[torch.Tensor, torch.Tensor, int] | None = None, lora: bool = True,
                 checkpointing: bool = False) -> torch.Tensor:
        """Hidden states after the final norm: [T] ids → [T, H] (arguments as `PackedDecoder.__call__`)."""
        x = F.embedding(input_ids, self.embed.weight) * self.embed_scale  # [T, H]
        rotary = {}
        for t in {layer.layer_type for layer in self.layers}:
            cos, sin = self.rotary_emb(x, position_ids[None], t)  # [1, T, D] each, in x's dtype
            rotary[t] = (cos[0], sin[0])
        recompute = checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            adapters = ({name: g.delta_inputs(x.dtype, layer.out_features[name]) for name, g in layer.lora.items()}
                        if lora else {})
            cos, sin = rotary[layer.layer_type]
            if recompute:
                x = checkpoint(_Recomputable(self._layer), layer, x, cos, sin, cu_seq_lens, max_seq_len, adapters,
                               keys, use_reentrant=False, preserve_rng_state=self.has_dropout)
            else:
                x = self._layer(layer, x, cos, sin, cu_seq_lens, max_seq_len, adapters, keys)
        return gemma_rms_norm(x, self.final_norm, self.eps)

    def _layer(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seq_lens: torch.Tensor,
               max_seq_len: int, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
               keys: tuple[torch.Tensor, torch.Tensor, int] | None = None, *, recomputing: bool = False) -> torch.Tensor:
        # `recomputing` is not used to skip the down GEMM as the Llama layer does: its output feeds
        # post_feedforward_norm, whose backward needs it
        T, eps = x.shape[0], self.eps
        h = gemma_rms_norm(x, layer.input_norm, eps)
        qkv = self._linear(h, layer.qkv, None, layer, "qkv", adapters)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        q = gemma_rms_norm(q.view(T, self.num_heads, self.head_dim), layer.q_norm, eps)
        k = gemma_rms_norm(k.view(T, self.num_kv_heads, self.head_dim), layer.k_norm, eps)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q = self.ops.rotary(q, cos, sin)
        k = self.ops.rotary(k, cos, sin)
        o = varlen_causal_attention(q, k, v, cu_seq_lens, max_seq_len, self.scale, window=layer.window, keys=keys)
        o = o.reshape(T, self.q_size)
        x = x + gemma_rms_norm(self._linear(o, layer.o, None, layer, "o", adapters), layer.post_attention_norm, eps)
        h = gemma_rms_norm(x, layer.pre_feedforward_norm, eps)
        act = gelu_and_mul(self._linear(h, layer.gate_up, None, layer, "gate_up", adapters))  # [T, I]
        down = self._linear(act, layer.down, None, layer, "down", adapters)
        return x + gemma_rms_norm(down, layer.post_feedforward_norm, eps)
