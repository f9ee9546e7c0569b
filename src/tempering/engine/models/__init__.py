"""Model code of the engine, by Hugging Face architecture name."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ConfigError
from ...modeling import MOE_ARCHITECTURES, covered_architecture
from ...modeling.gemma import unsupported_reason as gemma3_unsupported_reason
from ..layers.rotary import rope_is_static
from .gemma3 import GEMMA3_ARCHITECTURES, Gemma3Model
from .llama import SUPPORTED_ARCHITECTURES, LlamaFamilyModel
from .qwen3_moe import Qwen3MoeModel

__all__ = ["GEMMA3_ARCHITECTURES", "Gemma3Model", "LlamaFamilyModel", "Qwen3MoeModel", "SUPPORTED_ARCHITECTURES",
           "engine_model_for", "fallback_reason"]

log = logging.getLogger("tempering")



def _architecture(hf_model: Any) -> tuple[str | None, list[str]]:
    """(the covered architecture of `hf_model` or None, the names it goes by)."""
    archs = list(getattr(hf_model.config, "architectures", None) or [type(hf_model).__name__])
    return covered_architecture(hf_model, SUPPORTED_ARCHITECTURES + GEMMA3_ARCHITECTURES + MOE_ARCHITECTURES), archs


def fallback_reason(hf_model: Any, max_positions: int) -> str | None:
    """Why the tempering engine cannot run `hf_model` (None: it can)."""
    config = hf_model.config
    arch, archs = _architecture(hf_model)
    if arch is None:
        return f"the tempering engine has no model code for {archs}"
    if arch in GEMMA3_ARCHITECTURES:
        reason = gemma3_unsupported_reason(config)
        return f"{arch}: {reason}" if reason else None
    if not rope_is_static(config):
        return f"the tempering engine does not support rope scaling {getattr(config, 'rope_scaling', None)!r}"
    if arch in MOE_ARCHITECTURES and getattr(config, "sliding_window", None) and config.sliding_window < max_positions:
        return "sliding-window attention is not supported"
    mistral_window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if mistral_window and arch == "MistralForCausalLM":
        if config.sliding_window < max_positions:
            return "sliding-window attention is not supported"
    return None


def engine_model_for(hf_model: Any, max_positions: int, *, max_lora_rank: int = 16,
                     batch_invariant: bool = False,
                     tp: Any = None) -> LlamaFamilyModel | Gemma3Model | Qwen3MoeModel | None:
    """The engine's model bound to `hf_model`, or None (with a log line saying why) when it is not covered.

    `tp`: the tensor-parallel group when `hf_model` holds this rank's shards (the Llama family only).

    `max_lora_rank`: spare weight rows per LoRA slice on CUDA (see LlamaFamilyModel).
    `batch_invariant`: see EngineConfig.batch_invariant.

    Raises:
        ConfigError: `batch_invariant` for a model outside the Llama family, Gemma 3 and Qwen3-MoE.
    """
    reason = fallback_reason(hf_model, max_positions)
    arch = _architecture(hf_model)[0]
    exact = SUPPORTED_ARCHITECTURES + GEMMA3_ARCHITECTURES + MOE_ARCHITECTURES
    if batch_invariant and (reason is not None or arch not in exact):
        raise ConfigError(f"batch_invariant (exact on-policy) covers {exact}; {arch or type(hf_model).__name__} "
                          f"is not ({reason or 'no invariant kernels for it'}): leave EngineConfig.batch_invariant "
                          "off for it")
    if tp is not None and (reason is not None or arch not in SUPPORTED_ARCHITECTURES):
        raise ConfigError(f"tensor parallelism covers the Llama family {SUPPORTED_ARCHITECTURES}; "
                          f"{arch or type(hf_model).__name__} is not: use tensor_parallel_size 1")
    if reason is not None:
        log.warning("%s; falling back to the transformers engine", reason)
        return None
    if arch in GEMMA3_ARCHITECTURES:
        return Gemma3Model(hf_model, max_positions, max_lora_rank=max_lora_rank, batch_invariant=batch_invariant)
    if arch in MOE_ARCHITECTURES:
        return Qwen3MoeModel(hf_model, max_positions, max_lora_rank=max_lora_rank, batch_invariant=batch_invariant)
    return LlamaFamilyModel(hf_model, max_positions, max_lora_rank=max_lora_rank, batch_invariant=batch_invariant,
                            tp=tp)
