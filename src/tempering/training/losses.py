"""Policy-gradient surrogate losses per token, their aggregation weights, KL estimators and
importance-ratio corrections.

Notation: `ratio = exp(logprob_new - logprob_sampled)` is the token-level importance ratio
between the policy being trained and the one that sampled the token (the engine's logprobs are
used as π_old directly: "bypass mode" in verl's terms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from .tokenize import TokenizedSequence

__all__ = ["kl_estimate", "policy_loss", "sequence_mean", "token_weights"]


def token_weights(sequences: list[TokenizedSequence], aggregation: str, dr_grpo_normalizer: int | None) -> list[float]:
    """The loss weight of each trained token of each sequence, for one mini-batch.

    token_mean: 1 / (trained tokens in the mini-batch); sequence_mean: 1 / (sequences × this
    sequence's trained tokens); dr_grpo: 1 / (sequences × normalizer), the normalizer defaulting
    to the mini-batch's longest completion (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
    Training").

    Raises:
        ConfigError: for another `aggregation`.
    """
    counts = [s.num_completion_tokens for s in sequences]
    n = len(sequences)
    if aggregation == "token_mean":
        total = sum(counts)
        return [1.0 / total] * n
    if aggregation == "sequence_mean":
        return [1.0 / (n * c) if c else 0.0 for c in counts]
    if aggregation == "dr_grpo":
        normalizer = dr_grpo_normalizer or max(counts)
        return [1.0 / (n * normalizer)] * n
    raise ConfigError(f"unknown loss_aggregation {aggregation!r}")


def sequence_mean(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Mean of `values` [N] over the tokens of each sequence (`seq_index` [N] in [0, num_seqs)), broadcast back to [N]."""
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)
    counts = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, torch.ones_like(values))
    return (sums / counts.clamp_min(1))[seq_index]


def policy_loss(
    new_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_fn: str,
    clip_low: float,
    clip_high: float,
    seq_index: torch.Tensor | None = None,
    num_seqs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss (the caller weights and sums it), a clipped-token mask, and the ratio used.

    - "ppo": `-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)` with the token ratio r (PPO,
      Schulman et al. 2017, arXiv 1707.06347, eq. 7; clip-higher when clip_high > clip_low, DAPO,
      arXiv 2503.14476).
    - "cispo": `-sg(clip(r, 1 - clip_low, 1 + clip_high)) A log π_new` (MiniMax-M1, arXiv
      2506.13585, eq. 4): every token keeps a gradient; only its weight is clipped.
    - "gspo": the PPO objective with the sequence ratio `s = exp(mean over the sequence's tokens
      of (log π_new - log π_old))` for every token of the sequence (GSPO, Zheng et al. 2025,
      arXiv 2507.18071, eq. 5); needs `seq_index` and `num_seqs`. Each token carries its whole
      sequence's loss, so aggregate it with "sequence_mean".

    Args:
        new_logprobs: [N] logprobs under the current policy (with grad).
        sampled_logprobs: [N] logprobs at sampling time.
        advantages: [N] advantage of each token's trajectory.

    Returns:
        (loss [N], is_clipped [N] bool, ratio [N] detached: the token ratio, or the sequence
        ratio for GSPO).
    """
    log_ratio = new_logprobs - sampled_logprobs
    if loss_fn == "gspo":
        if seq_index is None:
            raise ValueError("gspo needs seq_index and num_seqs")
        log_ratio = sequence_mean(log_ratio, seq_index, num_seqs)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    is_clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).detach()
    if loss_fn in ("ppo", "gspo"):
        loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    elif loss_fn == "cispo":
        loss = -clipped_ratio.detach() * advantages * new_logprobs
    else:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; use 'ppo', 'cispo' or 'gspo'")
    return loss, is_clipped, ratio.detach()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π (Schulman 2020, "Approximating KL divergence").

    With d = log π_ref - log π at the sampled token:
    - "k1": -d (unbiased, high variance, can be negative);
    - "k2": d² / 2 (biased, low variance);
    - "k3": exp(d) - 1 - d (unbiased, low variance, always >= 0; GRPO's choice, arXiv 2402.03300 eq. 4).

    Args:
        logprobs: [N] under the policy (with grad).
        ref_logprobs: [N] under the reference (no grad).
    """
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - 1.0 - d
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")
