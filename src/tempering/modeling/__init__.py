"""The model's own tensors, shared by the engine and the trainer (a layer below both).

`weights`: q/k/v and gate/up fused into one tensor of which the Hugging Face modules' weights
become views; `lora`: references to PEFT's LoRA parameters grouped by fused projection;
`rotary`: the rotary embedding's math. Nothing here copies a weight.
"""

from __future__ import annotations

# Decoder families whose modeling the engine and the trainer implement themselves.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

__all__ = ["SUPPORTED_ARCHITECTURES"]
