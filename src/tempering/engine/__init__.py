"""The rollout engine: batched sampling with per-token logprobs from the policy being trained.

`Engine` (continuous batching, paged KV cache, prefix sharing, LoRA from the trainer's live
tensors) runs the architectures in `models/`; `HFEngine` runs any other transformers model.
"""

from .config import EngineConfig
from .engine import Engine
from .hf_engine import HFEngine
from .models import engine_model_for
from .request import BasePolicy, Completion, GenerationRequest, Policy
from .sampling_params import SamplingParams

__all__ = [
    "BasePolicy",
    "Completion",
    "Engine",
    "EngineConfig",
    "GenerationRequest",
    "HFEngine",
    "Policy",
    "SamplingParams",
    "engine_model_for",
]
