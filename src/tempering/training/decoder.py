"""The trainer's own forward pass for the Llama family: packed rows, fused LoRA, fused kernels.

Running the PEFT-wrapped transformers model costs a training step about as much time in small
elementwise kernels as in matrix products: PEFT adds each LoRA delta in three extra passes over
the projection's output, and q/k/v and gate/up are separate projections with separate LoRAs.
This forward reads the very same tensors (base weights as the fused q/k/v and gate/up views the
engine uses; LoRA A/B as PEFT's own parameters, so the optimizer, checkpoints and the engine are
unchanged) and computes, per projection group,

    y = x W^T + b + s · (x A_cat^T) B_blockdiag^T        (one addmm for all LoRAs of the group)

with A_cat the stacked A's and B_blockdiag the block-diagonal of the B's, plus fused RMSNorm and
SwiGLU with their backward passes (kernels.py). Attention is varlen over the packed row
(attention.py); each decoder layer is optionally recomputed in the backward pass. The math is
Hugging Face's: tests check logprobs and LoRA gradients against the PEFT model.

References: LoRA (Hu et al. 2021, arXiv 2106.09685); Llama (arXiv 2302.13971); selective layer
recomputation (Chen et al. 2016, arXiv 1604.06174).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..engine.layers.rotary import apply_rotary
from ..engine.lora import collect_adapter
from ..engine.models import SUPPORTED_ARCHITECTURES
from ..engine.weights import base_layer, fuse_linears
from .attention import varlen_causal_attention
from .kernels import ops_for

__all__ = ["PackedDecoder"]

log = logging.getLogger("tempering")


@dataclass(slots=True)
class _GroupLoRA:
    """All LoRAs of one fused projection: y[:, cols] += s (x A_cat^T) B_bd^T."""

    A: list[torch.Tensor]  # each [r, in], PEFT's parameters
    B: list[torch.Tensor]  # each [out_i, r]
    scale: float
    cols: slice  # the fused output columns the B's cover, in order
    dropout: float

    def delta_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        A = self.A[0] if len(self.A) == 1 else torch.cat(self.A, dim=0)
        B = self.B[0] if len(self.B) == 1 else torch.block_diag(*self.B)
        return A.to(dtype), B.to(dtype)


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


def _group(entries: list[Any], module_dropouts: list[float]) -> _GroupLoRA | None:
    if not entries:
        return None
    scales = {e.scale for e in entries}
    contiguous = all(a.out.stop == b.out.start for a, b in zip(entries, entries[1:]))
    if len(scales) != 1 or not contiguous:
        raise ValueError("LoRAs of one fused projection need one scale and adjacent outputs")
    start = entries[0].out.start or 0
    stop = entries[-1].out.stop
    return _GroupLoRA([e.A for e in entries], [e.B for e in entries], entries[0].scale, slice(start, stop),
                      max(module_dropouts, default=0.0))


def _dropout_p(module: Any, adapter: str) -> float:
    dropouts = getattr(module, "lora_dropout", None)
    if dropouts is None or adapter not in dropouts:
        return 0.0
    return float(getattr(dropouts[adapter], "p", 0.0))  # nn.Dropout, or nn.Identity for 0


class PackedDecoder:
    """Final hidden states [T, H] of one packed row, differentiable in the LoRA parameters.

    Build it with `PackedDecoder.maybe(peft_model)`, which returns None for architectures it does
    not cover (the trainer then runs the transformers model itself).
    """

    def __init__(self, peft_model: Any, adapter: str) -> None:
        hf = peft_model.get_base_model()
        config = hf.config
        inner = hf.model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
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
        self.training = True

    @classmethod
    def maybe(cls, peft_model: Any, adapter: str) -> PackedDecoder | None:
        """A decoder for `peft_model`, or None if its architecture or adapter is not covered."""
        hf = peft_model.get_base_model()
        config = hf.config
        if not any(a in SUPPORTED_ARCHITECTURES for a in (getattr(config, "architectures", None) or [])) \
                and type(hf).__name__ not in SUPPORTED_ARCHITECTURES:
            return None
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(peft_model.peft_config[adapter], "use_dora", False):
            return None
        try:
            return cls(peft_model, adapter)
        except ValueError as exc:
            log.info("training with the transformers forward: %s", exc)
            return None

    # ---- forward ------------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seq_lens: torch.Tensor,
                 max_seq_len: int, *, lora: bool = True, checkpointing: bool = False) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: [T] int64 token ids of the packed row.
            position_ids: [T] int64, restarting at 0 at each sequence start.
            cu_seq_lens: [S + 1] int32 cumulative sequence lengths.
            max_seq_len: the longest sequence.
            lora: False runs the base model (the adapter switched off, as for a KL reference).
            checkpointing: recompute each layer in the backward pass instead of keeping its activations.

        Returns:
            [T, H] in the model dtype.
        """
        x = F.embedding(input_ids, self.embed.weight)  # [T, H]
        cos, sin = self.rotary_emb(x, position_ids[None])  # [1, T, D] each, in x's dtype
        cos, sin = cos[0], sin[0]
        recompute = checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x = checkpoint(self._layer, layer, x, cos, sin, cu_seq_lens, max_seq_len, lora, use_reentrant=False)
            else:
                x = self._layer(layer, x, cos, sin, cu_seq_lens, max_seq_len, lora)
        return self.ops.rms_norm(x, self.final_norm, self.eps)

    def _layer(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seq_lens: torch.Tensor,
               max_seq_len: int, lora: bool) -> torch.Tensor:
        T = x.shape[0]
        ops = self.ops
        h = ops.rms_norm(x, layer.input_norm, self.eps)
        qkv = self._linear(h, layer.qkv, layer.qkv_bias, layer.lora.get("qkv") if lora else None)
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:  # Qwen3: RMSNorm of each head before the rotation
            q = ops.rms_norm(q, layer.q_norm, self.eps)
            k = ops.rms_norm(k, layer.k_norm, self.eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        o = varlen_causal_attention(q, k, v, cu_seq_lens, max_seq_len, self.scale, window=layer.window)
        o = o.reshape(T, self.q_size)
        x = x + self._linear(o, layer.o, layer.o_bias, layer.lora.get("o") if lora else None)
        h = ops.rms_norm(x, layer.post_norm, self.eps)
        gate_up = self._linear(h, layer.gate_up, layer.gate_up_bias, layer.lora.get("gate_up") if lora else None)
        act = ops.silu_and_mul(gate_up)
        return x + self._linear(act, layer.down, layer.down_bias, layer.lora.get("down") if lora else None)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: _GroupLoRA | None) -> torch.Tensor:
        """x W^T + b, plus the group's LoRA deltas in one more matmul: [T, in] → [T, out]."""
        y = F.linear(x, weight, bias)
        if lora is None:
            return y
        A, B = lora.delta_inputs(x.dtype)
        xa = x if lora.dropout == 0 or not self.training else F.dropout(x, lora.dropout)
        low = xa @ A.T  # [T, k r]
        if lora.cols.start == 0 and lora.cols.stop == y.shape[1]:
            return torch.addmm(y, low, B.T, alpha=lora.scale)
        y = y.clone()
        y[:, lora.cols] = torch.addmm(y[:, lora.cols], low, B.T, alpha=lora.scale)
        return y


def _sliding_window(config: Any, layer: int) -> int | None:
    """Layer `layer`'s attention window, as transformers' modeling code reads it from the config."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and layer_types[layer] != "sliding_attention"):
        return None
    return window  # Mistral (no layer types: every layer), or a Qwen2/Qwen3 sliding layer
