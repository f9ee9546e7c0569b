"""How many policy versions old the sampled tokens of a training batch are.

The engine stamps every sampled token with the policy version (training step) of the weights that
sampled it (`choice.policy_versions`, one per `choice.token_ids`). A batch trained at step s on
tokens of version v is s - v steps off-policy for those tokens: 0 in the sequential loop, up to
`max_staleness` in a pipelined one. The importance ratio against the sampled logprobs corrects
for it token by token (TrainConfig's TIS and masking bound the correction); these numbers show
how far it had to reach.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..types import TrajectoryGroup

__all__ = ["policy_age_metrics"]


def policy_age_metrics(groups: Iterable[TrajectoryGroup], step: int) -> dict[str, float]:
    """Token ages (`step` - version) of the groups' sampled tokens, for a step trained from `step`.

    Returns:
        {} when no token carries a version; else `offpolicy/policy_age_mean` and `_max` (steps, over
        tokens) and `data/step_num_trajectories_spanning_update` (trajectories whose tokens come
        from more than one version: a training step ended while they were being sampled).
    """
    total, count, oldest, spanning = 0, 0, 0, 0
    for group in groups:
        for trajectory in group:
            versions = trajectory.policy_versions()
            if not versions:
                continue
            ages = [step - v for v in versions]
            total += sum(ages)
            count += len(ages)
            oldest = max(oldest, *ages)
            spanning += len(set(versions)) > 1
    if not count:
        return {}
    return {
        "offpolicy/policy_age_mean": total / count,
        "offpolicy/policy_age_max": float(oldest),
        "data/step_num_trajectories_spanning_update": float(spanning),
    }
