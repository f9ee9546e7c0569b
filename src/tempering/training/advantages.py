"""Group-relative advantages (GRPO, Shao et al. 2024, arXiv 2402.03300 section 4.1.2)."""

from __future__ import annotations

import math

__all__ = ["group_advantages"]


def group_advantages(rewards_G: list[float], *, normalize: bool, eps: float = 1e-6) -> list[float]:
    """Advantages of one group: A_i = r_i - mean(r), divided by std(r) + eps when `normalize`.

    The std is the population std (as in ART and TRL). A group whose rewards are all equal
    (zero spread) gets all-zero advantages: it carries no learning signal.

    Args:
        rewards_G: the G rewards of one group (finite floats).

    Returns:
        G floats.
    """
    G = len(rewards_G)
    if G == 0:
        return []
    if max(rewards_G) == min(rewards_G):  # (not |r - mean| < tol: for rewards ~1e4 the mean's rounding is larger)
        return [0.0] * G
    mean = sum(rewards_G) / G
    centered = [r - mean for r in rewards_G]
    if not normalize:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / G)
    return [c / (std + eps) for c in centered]
