"""Model code of the engine, by Hugging Face architecture name."""

from __future__ import annotations

import logging
from typing import Any

from ..layers.rotary import rope_is_static
from .llama import SUPPORTED_ARCHITECTURES, LlamaFamilyModel
from .qwen3_moe import Qwen3MoeModel

__all__ = ["LlamaFamilyModel", "Qwen3MoeModel", "SUPPORTED_ARCHITECTURES", "engine_model_for"]

log = logging.getLogger("tempering")


def engine_model_for(hf_model: Any, max_positions: int, *, max_lora_rank: int = 16
                     ) -> LlamaFamilyModel | Qwen3MoeModel | None:
    """The engine's model bound to `hf_model`, or None (with a log line) when the architecture is not covered.

    `max_lora_rank`: spare weight rows per LoRA slice on CUDA (see LlamaFamilyModel).
    """
    config = hf_model.config
    archs = list(getattr(config, "architectures", None) or [type(hf_model).__name__])
    if "Qwen3MoeForCausalLM" in archs or type(hf_model).__name__ == "Qwen3MoeForCausalLM":
        if not rope_is_static(config):
            log.warning("the tempering engine does not support rope scaling %r; falling back to the transformers "
                        "engine", getattr(config, "rope_scaling", None))
            return None
        if getattr(config, "sliding_window", None) and config.sliding_window < max_positions:
            log.warning("sliding-window attention is not supported; falling back to the transformers engine")
            return None
        return Qwen3MoeModel(hf_model, max_positions, max_lora_rank=max_lora_rank)
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and type(hf_model).__name__ in SUPPORTED_ARCHITECTURES:
        arch = type(hf_model).__name__
    if arch is None:
        log.warning("the tempering engine has no model code for %s; falling back to the transformers engine", archs)
        return None
    if not rope_is_static(config):
        log.warning("the tempering engine does not support rope scaling %r; falling back to the transformers engine",
                    getattr(config, "rope_scaling", None))
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and arch == "MistralForCausalLM":
        if config.sliding_window < max_positions:
            log.warning("sliding-window attention is not supported; falling back to the transformers engine")
            return None
    return LlamaFamilyModel(hf_model, max_positions, max_lora_rank=max_lora_rank)
