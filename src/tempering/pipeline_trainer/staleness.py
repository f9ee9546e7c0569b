"""Policy versions of finished groups, and how many rollouts may be in flight for a staleness bound.

A token's policy version is the training step whose weights sampled it (the server stamps it on
`choice.policy_versions`). A group trained at step s whose oldest token has version v is s - v
steps stale. `max_staleness` bounds that: 0 is on-policy (sequential), 1 lets the rollouts of the
next batch run while the current one trains (one-step off-policy, as PipelineRL and verl's
one-step-off pipeline).
"""

from __future__ import annotations

from ..types import TrajectoryGroup

__all__ = ["group_staleness", "max_groups_ahead", "stamp_versions"]


def stamp_versions(group: TrajectoryGroup, *, started: int, finished: int) -> None:
    """Set each trajectory's `initial_policy_version` and `final_policy_version` (ART's fields).

    From its tokens' versions when the server stamped them; otherwise from the pipeline's version
    when the rollout started and finished (`started`, `finished`). Values already set are kept.
    """
    for trajectory in group.trajectories:
        versions = trajectory.policy_versions()
        if trajectory.initial_policy_version is None:
            trajectory.initial_policy_version = min(versions) if versions else started
        if trajectory.final_policy_version is None:
            trajectory.final_policy_version = max(versions) if versions else finished


def group_staleness(group: TrajectoryGroup, step: int) -> int:
    """Steps between `step` (the version a batch is trained from) and the group's oldest token."""
    initial = [t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None]
    return step - min(initial) if initial else 0


def max_groups_ahead(*, groups_per_step: int, max_staleness: int, is_training: bool) -> int:
    """How many groups may be finished or running, not yet trained, for none to exceed `max_staleness`.

    Batches are taken in order, `groups_per_step` at a time. A group started now at version v lands
    in the k-th coming batch (k = groups ahead of it // groups_per_step + 1), trained from version
    v + k - 1, or v + k while a step is running (that step's result comes first). Requiring
    k - 1 (or k) <= max_staleness gives the bound. Groups that finish out of order can still land
    one batch later; the trainer drops those (`group_staleness` > max_staleness) and counts them.
    """
    return groups_per_step * (max_staleness + (0 if is_training else 1))
