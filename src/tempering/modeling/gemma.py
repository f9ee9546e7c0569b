"""Gemma 3's own elementwise math, shared by the engine and the trainer.

Gemma 3 (Gemma Team 2025, arXiv 2503.19786) differs from the Llama family in three elementwise
places, all written here once, exactly as transformers' `modeling_gemma3` computes them:

- RMSNorm multiplies by `(1 + w)` (the weights are stored zero-centred) and rounds once, after
  the multiplication, where Llama's rounds before it (transformers PR 29402);
- the MLP is GeGLU, `gelu_tanh(gate) * up` (Shazeer 2020, arXiv 2002.05202);
- the token embedding is scaled by `sqrt(hidden)`, rounded to the model dtype first.

The rest (fused q/k/v and gate/up views, LoRA, rotary, attention) is the Llama family's code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["GEMMA3_ARCHITECTURES", "embed_scale", "gelu_and_mul", "gemma_rms_norm", "norm_gain", "unsupported_reason"]

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM",)  # what the engine's and the trainer's Gemma 3 code cover


def norm_gain(norm: Any) -> torch.Tensor:
    """The gain `1 + w` [H] of a Gemma RMSNorm module, in float32 (a new tensor: w is frozen)."""
    return 1.0 + norm.weight.detach().float()


def gemma_rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """`gain * x / sqrt(mean(x^2) + eps)` in float32, rounded once to x's dtype (differentiable).

    Args:
        x: [..., H] activations (any float dtype; rows may be strided views, e.g. heads of q/k).
        gain: [H] float32, `1 + w` (see `norm_gain`).

    Returns:
        [..., H] in x's dtype.
    """
    if x.is_cuda:  # one fused kernel each way instead of five
        return F.rms_norm(x.float(), (x.shape[-1],), gain, eps).to(x.dtype)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gain).to(x.dtype)


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU of a fused gate/up projection: gelu_tanh(gate) * up, [N, 2I] → [N, I] (differentiable)."""
    half = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :half], approximate="tanh") * gate_up[..., half:]


def embed_scale(config: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """sqrt(hidden) as a 0-d tensor in the model dtype (HF rounds it to bf16: 25.30 → 25.25 at H = 640)."""
    return torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32).to(dtype=dtype, device=device)


def unsupported_reason(config: Any) -> str | None:
    """Why tempering's own Gemma 3 code cannot run this config (None: it can).

    Attention-logit softcapping (Gemma 2; None in every Gemma 3 config), a final-logit softcap,
    bidirectional attention (EmbeddingGemma) and rope types whose table depends on the sequence
    length are left to transformers.
    """
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention-logit softcapping is not implemented"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "final-logit softcapping is not implemented"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention is not implemented"
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return f"activation {config.hidden_activation!r} is not implemented"
    if getattr(config, "attention_bias", False):
        return "biased attention projections are not implemented"
    params = getattr(config, "rope_parameters", None) or {}
    for layer_type in set(getattr(config, "layer_types", None) or []):
        kind = (params.get(layer_type) or {}).get("rope_type", "default")
        if kind not in ("default", "linear", "llama3", "yarn"):
            return f"rope type {kind!r} (of the {layer_type} layers) is not supported"
    return None
