"""Run many rollouts concurrently: `gather_trajectory_groups` and `gather_trajectories`."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from .types import GatherContext, Trajectory, TrajectoryGroup, gather_context

__all__ = ["gather_trajectories", "gather_trajectory_groups"]

AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


class _Progress:
    """A tqdm bar over trajectories with the running mean reward and the exception count."""

    def __init__(self, desc: str | None, total: int | None) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="traj", disable=desc is None, dynamic_ncols=True)
        self.rewards: list[float] = []
        self.num_exceptions = 0

    def update(self, trajectories: list[Trajectory], num_exceptions: int) -> None:
        self.rewards += [t.reward for t in trajectories]
        self.num_exceptions += num_exceptions
        postfix: dict[str, Any] = {}
        if self.rewards:
            postfix["reward"] = f"{sum(self.rewards) / len(self.rewards):.3f}"
        if self.num_exceptions:
            postfix["exceptions"] = self.num_exceptions
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(len(trajectories) + num_exceptions)

    def close(self) -> None:
        self.bar.close()


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Run every group's rollouts concurrently and return the finished groups, in input order.

    Args:
        groups: TrajectoryGroups built from rollout coroutines (ART style), or coroutines that
            return TrajectoryGroups.
        pbar_desc: progress bar label (None hides the bar).
        max_exceptions: how many failed rollouts to tolerate across all groups (a value in (0, 1)
            is a fraction of all rollouts); failed rollouts are kept in `group.exceptions`.
            One more failure re-raises that exception and cancels the rest.
        after_each: `async f(group)` run on each group as soon as it is done (e.g. RULER
            scoring); returning None drops the group, a list replaces it with several.
        pbar_total_completion_tokens, max_metrics: accepted for ART compatibility.

    Returns:
        The groups; a group that is empty because all its rollouts failed is still returned.
    """
    items = list(groups)
    total = sum(len(g._pending) + len(g.trajectories) for g in items if isinstance(g, TrajectoryGroup))
    context = GatherContext(max_exceptions=max_exceptions, num_trajectories=total)
    progress = _Progress(pbar_desc, total or None)

    async def run(item: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> list[TrajectoryGroup]:
        gather_context.set(context)
        if isinstance(item, TrajectoryGroup):
            before = len(item.trajectories), len(item.exceptions)
            group = await item
        else:
            before = (0, 0)
            group = await item
            if not isinstance(group, TrajectoryGroup):
                raise TypeError(f"gather_trajectory_groups expects TrajectoryGroups, got {type(group).__name__}")
            group = await group  # a coroutine may return a pending group
        progress.update(group.trajectories[before[0]:], len(group.exceptions) - before[1])
        if after_each is None:
            return [group]
        result = after_each(group)
        result = await result if inspect.isawaitable(result) else result
        if result is None:
            return []
        return result if isinstance(result, list) else [result]

    tasks = [asyncio.ensure_future(run(item)) for item in items]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        progress.close()
    return [group for result in results for group in result]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory | Iterable[Trajectory]]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
) -> list[Trajectory | BaseException]:
    """Run rollouts concurrently and return their trajectories in input order (flattened).

    With `max_exceptions > 0`, failed rollouts appear in place as their exceptions while the
    budget lasts; past it (or with the default 0) the first failure is raised.
    """
    items = list(trajectories)
    context = GatherContext(max_exceptions=max_exceptions, num_trajectories=len(items))
    progress = _Progress(pbar_desc, len(items))

    async def run(awaitable: Awaitable[Any]) -> list[Trajectory | BaseException]:
        try:
            result = await awaitable
        except Exception as exc:
            if not context.allows_one_more_exception():
                raise
            context.num_exceptions += 1
            progress.update([], 1)
            return [exc]
        out = [result] if isinstance(result, Trajectory) else list(result)
        progress.update([t for t in out if isinstance(t, Trajectory)], 0)
        return out

    tasks = [asyncio.ensure_future(run(a)) for a in items]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        progress.close()
    return [t for result in results for t in result]


