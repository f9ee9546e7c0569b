"""ART's experimental per-step options (`model.train(..., _config=art.dev.TrainConfig(...))`)."""

from __future__ import annotations

from typing import Literal, TypedDict

__all__ = ["TrainConfig", "TrainSFTConfig"]


class TrainConfig(TypedDict, total=False):
    """ART's `dev.TrainConfig` keys; each is mapped to tempering's TrainConfig or checked as
    the table of ART options in docs/guides/art-compatibility.md says (the same options as `backend.train`)."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kimi_k2_tau: float | None
    kl_penalty_coef: float
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float | None
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


class TrainSFTConfig(TypedDict, total=False):
    """ART's experimental SFT options (none are defined)."""
