"""Gemma 3 (text) as a flat-batch decoder over the paged KV cache.

Covers `Gemma3ForCausalLM` (Gemma 3 270M and 1B; the text tower of the larger ones). Against the
Llama family (llama.py) a Gemma 3 layer has

- interleaved local and global attention: `config.layer_types` says which layers slide over
  the last `sliding_window` keys; the two kinds use two rotary bases (10k local, 1M global);
- RMSNorm of each head's q and k before the rotation (as Qwen3), and the softmax scale
  `query_pre_attn_scalar ** -0.5` instead of `head_dim ** -0.5`;
- four norms per layer: the attention and MLP outputs are normalized before they join the
  residual stream (sandwich norm), every norm multiplying by (1 + w) (modeling/gemma.py);
- GeGLU instead of SwiGLU, and the token embedding scaled by sqrt(hidden); tied LM head.

It reads the Hugging Face model's own tensors (q/k/v and gate/up fused as views, shared with the
trainer) and applies the live LoRA through `linear_with_segments` (Triton shrink/expand kernels on CUDA, rounded once);
decode steps are captured in CUDA graphs by the runner like the Llama family's. In batch-invariant
mode (exact on-policy) the products, the LoRA kernels and the attention, sliding windows included,
are the Llama family's invariant kernels, and every RMSNorm one Triton program per row.

References: Gemma 3 technical report (Gemma Team 2025, arXiv 2503.19786); transformers'
`models/gemma3/modeling_gemma3.py`, which the tests compare against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...modeling.gemma import GEMMA3_ARCHITECTURES, embed_scale, gelu_and_mul, gemma_rms_norm, norm_gain
from ...modeling.weights import base_layer, fuse_linears
from ..context import StepContext
from ..layers import RotaryTable, ops_for, paged_attention
from ..lora import LoRASegment, linear_with_segments

__all__ = ["GEMMA3_ARCHITECTURES", "Gemma3Model"]



@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [H] float32 gains (1 + w)
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o: torch.Tensor  # [H, Hq D]
    post_attention_norm: torch.Tensor  # [H]
    pre_feedforward_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]
    post_feedforward_norm: torch.Tensor  # [H]
    layer_type: str  # "sliding_attention" or "full_attention": the rotary table
    window: int | None  # sliding attention window


class Gemma3Model:
    """A Gemma 3 decoder bound to `hf_model`'s weights (no copy; q/k/v and gate/up become fused views).

    Args:
        hf_model: a loaded `Gemma3ForCausalLM` (check `modeling.gemma.unsupported_reason` first).
        max_positions: longest position the rotary tables cover.
        max_lora_rank: unused (the spare-rows LoRA path is the Llama family's); accepted for
            the registry's uniform call.
        batch_invariant: every token computed the same whatever its batch (EngineConfig.batch_invariant).
    """

    spare_rows = None  # the live adapter goes through linear_with_segments (shrink/expand), never spare rows

    def __init__(self, hf_model: Any, max_positions: int, *, max_lora_rank: int = 16,
                 batch_invariant: bool = False) -> None:
        config = hf_model.config
        inner = hf_model.model
        self.hf_layers = list(inner.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.eps = config.rms_norm_eps
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.embed_scale = embed_scale(config, self.dtype, self.device)
        self.norm = norm_gain(inner.norm)
        self.lm_head = hf_model.lm_head.weight  # [V, H], the embedding itself (tied)
        self.rotary = {t: RotaryTable(functools.partial(inner.rotary_emb, layer_type=t), max_positions, self.dtype,
                                      self.device) for t in sorted(set(config.layer_types))}
        self.batch_invariant = batch_invariant
        self.ops = ops_for(self.device, batch_invariant=batch_invariant)
        self.norm_fn = gemma_rms_norm
        if self.ops.batch_invariant:  # CUDA with Triton (ops_for)
            from ..layers.triton_ops import gemma_rms_norm as invariant_rms_norm

            self.norm_fn = invariant_rms_norm
        self.layers: list[_Layer] = []
        self.fused_slices: dict[str, dict[str, slice]] = {}
        for i, layer in enumerate(self.hf_layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, _, qkv_slices = fuse_linears(
                [base_layer(attn.q_proj), base_layer(attn.k_proj), base_layer(attn.v_proj)], ["q_proj", "k_proj", "v_proj"])
            gate_up, _, gate_up_slices = fuse_linears([base_layer(mlp.gate_proj), base_layer(mlp.up_proj)],
                                                      ["gate_proj", "up_proj"])
            self.fused_slices = {"qkv": qkv_slices, "gate_up": gate_up_slices}
            layer_type = config.layer_types[i]
            self.layers.append(_Layer(
                input_norm=norm_gain(layer.input_layernorm),
                qkv=qkv,
                q_norm=norm_gain(attn.q_norm),
                k_norm=norm_gain(attn.k_norm),
                o=base_layer(attn.o_proj).weight,
                post_attention_norm=norm_gain(layer.post_attention_layernorm),
                pre_feedforward_norm=norm_gain(layer.pre_feedforward_layernorm),
                gate_up=gate_up,
                down=base_layer(mlp.down_proj).weight,
                post_feedforward_norm=norm_gain(layer.post_feedforward_layernorm),
                layer_type=layer_type,
                window=config.sliding_window if layer_type == "sliding_attention" else None,
            ))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bind_lora(self, lora: list[LoRASegment], num_rows: int) -> bool:
        """No spare rows: the forward applies the adapter through `linear_with_segments` (always False)."""
        return False

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
        ops, eps, norm = self.ops, self.eps, self.norm_fn
        x = F.embedding(input_ids, self.embed) * self.embed_scale  # [N, H]
        rotary = {t: table(positions) for t, table in self.rotary.items()}  # cos, sin [N, D] per layer type
        for i, layer in enumerate(self.layers):
            h = norm(x, layer.input_norm, eps)
            qkv = linear_with_segments(h, layer.qkv, None, lora, i, "qkv", ops)  # [N, (Hq + 2Hkv) D]
            q = qkv[:, : self.q_size].view(N, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(N, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(N, self.num_kv_heads, self.head_dim)
            q = norm(q, layer.q_norm, eps)
            k = norm(k, layer.k_norm, eps)
            cos, sin = rotary[layer.layer_type]
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            ops.rotary_and_store_(q, k, v, cos, sin, k_cache, v_cache, ctx.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, ctx, self.scale, layer.window,
                                batch_invariant=self.batch_invariant).reshape(N, self.q_size)
            attn_out = linear_with_segments(o, layer.o, None, lora, i, "o", ops)
            x = x + norm(attn_out, layer.post_attention_norm, eps)
            h = norm(x, layer.pre_feedforward_norm, eps)
            gate_up = linear_with_segments(h, layer.gate_up, None, lora, i, "gate_up", ops)  # [N, 2I]
            act = gelu_and_mul(gate_up)  # [N, I]
            down = linear_with_segments(act, layer.down, None, lora, i, "down", ops)
            x = x + norm(down, layer.post_feedforward_norm, eps)
        return norm(x, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] → [S, V] float32 logits, unrounded (modeling/precision.py; batch-invariant in that mode)."""
        return self.ops.linear_f32(hidden, self.lm_head)
