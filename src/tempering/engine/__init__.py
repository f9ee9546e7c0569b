"""The rollout engine: batched sampling with per-token logprobs from the policy being trained."""

from .hf_engine import HFEngine
from .request import BasePolicy, Completion, GenerationRequest, Policy
from .sampling_params import SamplingParams

__all__ = ["BasePolicy", "Completion", "GenerationRequest", "HFEngine", "Policy", "SamplingParams"]
