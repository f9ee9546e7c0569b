"""The model's own tensors, shared by the engine and the trainer (a layer below both).

`weights`: q/k/v and gate/up fused into one tensor of which the Hugging Face modules' weights
become views; `lora`: references to PEFT's LoRA parameters grouped by fused projection;
`rotary`: the rotary embedding's math. Nothing here copies a weight.
"""

from __future__ import annotations

from typing import Any

# Decoder families whose modeling the engine and the trainer implement themselves.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)

__all__ = ["MOE_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "covered_architecture"]


def covered_architecture(hf_model: Any, architectures: tuple[str, ...]) -> str | None:
    """The one of `architectures` that `hf_model` is, by its config's `architectures` or else its
    class name; None when it is none of them."""
    names = [*(getattr(hf_model.config, "architectures", None) or []), type(hf_model).__name__]
    return next((a for a in names if a in architectures), None)
