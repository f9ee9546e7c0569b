"""Policy-gradient surrogate losses per token.

Notation: `ratio = exp(logprob_new - logprob_sampled)` is the token-level importance ratio
between the policy being trained and the one that sampled the token.
"""

from __future__ import annotations

import torch

__all__ = ["policy_loss"]


def policy_loss(
    new_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss_fn: str,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss (to be summed and normalized by the caller) and a clipped-token mask.

    - "ppo": `-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)` (PPO, Schulman et al.
      2017, arXiv 1707.06347, eq. 7; clip-higher when clip_high > clip_low, DAPO arXiv 2503.14476).
    - "cispo": `-sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logprob_new` (MiniMax-M1,
      arXiv 2506.13585, eq. 4): every token keeps a gradient; only its weight is clipped.

    Args:
        new_logprobs: [N] logprobs under the current policy (with grad).
        sampled_logprobs: [N] logprobs at sampling time.
        advantages: [N] advantage of each token's trajectory.

    Returns:
        (loss [N], is_clipped [N] bool: the ratio was outside the clip range).
    """
    log_ratio = new_logprobs - sampled_logprobs
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    is_clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    if loss_fn == "ppo":
        loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    elif loss_fn == "cispo":
        loss = -clipped_ratio.detach() * advantages * new_logprobs
    else:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; use 'ppo' or 'cispo'")
    return loss, is_clipped.detach()
