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
from typing import Any

import torch
import torch.nn.functional as F

from ...modeling import SUPPORTED_ARCHITECTURES
from ...modeling.weights import base_layer, fuse_linears
from ..context import StepContext
from ..layers import RotaryTable, ops_for, paged_attention, store_kv
from ..lora import LoRASegment, add_lora, lora_silu_and_mul

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
    """

    def __init__(self, hf_model: Any, max_positions: int) -> None:
        config = hf_model.config
        inner = hf_model.model
        self.hf_layers = list(inner.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
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
        self.ops = ops_for(self.device)
        self.layers: list[_Layer] = []
        self.fused_slices: dict[str, dict[str, slice]] = {}
        for layer in self.hf_layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias, qkv_slices = fuse_linears(
                [base_layer(attn.q_proj), base_layer(attn.k_proj), base_layer(attn.v_proj)], ["q_proj", "k_proj", "v_proj"]
            )
            gate_up, _, gate_up_slices = fuse_linears(
                [base_layer(mlp.gate_proj), base_layer(mlp.up_proj)], ["gate_proj", "up_proj"]
            )
            self.fused_slices = {"qkv": qkv_slices, "gate_up": gate_up_slices}
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=q_norm.weight if q_norm is not None else None,
                k_norm=k_norm.weight if k_norm is not None else None,
                o=base_layer(attn.o_proj).weight,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=gate_up,
                down=base_layer(mlp.down_proj).weight,
            ))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate_size = self.layers[0].gate_up.shape[0] // 2

    @property
    def num_layers(self) -> int:
        return len(self.layers)

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
        ops = self.ops
        x = F.embedding(input_ids, self.embed)  # [N, H]
        residual = None
        cos, sin = self.rotary(positions)  # [N, D] each
        for i, layer in enumerate(self.layers):
            if residual is None:
                h, residual = ops.rms_norm(x, layer.input_norm, self.eps), x
            else:  # the previous layer's MLP output joins the residual stream here
                h, residual = ops.add_rms_norm(x, residual, layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [N, (Hq + 2Hkv) D]
            if lora:
                add_lora(qkv, h, lora, i, "qkv")
            q = qkv[:, : self.q_size].view(N, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(N, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(N, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None:  # Qwen3: RMSNorm of each head before the rotation
                q = ops.rms_norm(q, layer.q_norm, self.eps)
                k = ops.rms_norm(k, layer.k_norm, self.eps)
            ops.rotary_(q, cos, sin)
            ops.rotary_(k, cos, sin)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            store_kv(k_cache, v_cache, k, v, ctx.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, ctx, self.scale).reshape(N, self.q_size)  # [N, Hq D]
            attn_out = F.linear(o, layer.o)
            if lora:
                add_lora(attn_out, o, lora, i, "o")
            h, residual = ops.add_rms_norm(attn_out, residual, layer.post_norm, self.eps)
            gate_up = F.linear(h, layer.gate_up)  # [N, 2I]
            if lora:
                act = lora_silu_and_mul(gate_up, h, lora, i, ops.silu_and_mul)  # [N, I]
            else:
                act = ops.silu_and_mul(gate_up)
            x = F.linear(act, layer.down)
            if lora:
                add_lora(x, act, lora, i, "down")
        return ops.add_rms_norm(x, residual, self.norm, self.eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] → [S, V] logits in the model dtype (the sampler reads them in float32)."""
        return F.linear(hidden, self.lm_head)
