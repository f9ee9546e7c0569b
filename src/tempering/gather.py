"""Run many rollouts concurrently: `gather_trajectory_groups` and `gather_trajectories`."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from .types import GatherContext, Trajectory, TrajectoryGroup, gather_context, gather_item

__all__ = ["gather_trajectories", "gather_trajectory_groups"]

AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


class _Progress:
    """A tqdm bar over trajectories with the running mean reward and the exception count."""

    def __init__(self, desc: str | None, total: int | None) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="traj", disable=desc is None, dynamic_ncols=True)
        self.rewards: list[float] = []
        self.num_exceptions = 0

    def update(self, trajectories: list[Trajectory], num_exceptions: int, total: int | None = None) -> None:
        self.rewards += [t.reward for t in trajectories]
        self.num_exceptions += num_exceptions
        postfix: dict[str, Any] = {}
        if self.rewards:
            postfix["reward"] = f"{sum(self.rewards) / len(self.rewards):.3f}"
        if self.num_exceptions:
            postfix["exceptions"] = self.num_exceptions
        if total:  # a coroutine item's group size is known once it runs
            self.bar.total = total
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
            is a fraction of all rollouts, a coroutine item counting as the rollouts of the group
            it awaits once that is known, as 1 before); failed rollouts are kept in
            `group.exceptions`. A coroutine item that raises itself counts as one failure and its
            group is left out (as in ART). One failure more re-raises that exception and cancels
            the rest.
        after_each: `async f(group)` run on each group as soon as it is done (e.g. RULER
            scoring); returning None drops the group, a list replaces it with several.
        pbar_total_completion_tokens, max_metrics: accepted for ART compatibility.

    Returns:
        The groups; a group that is empty because all its rollouts failed is still returned.

    Raises:
        Exception: the failure past `max_exceptions`, whatever the rollout raised.
        TypeError: a coroutine item that returns something other than a TrajectoryGroup.
    """
    items = list(groups)
    context = GatherContext(max_exceptions=max_exceptions)
    for item in items:
        if isinstance(item, TrajectoryGroup):
            context.count_group(item)
        else:  # 1 until the group it awaits is known (GatherContext.count_group)
            context.num_trajectories += 1
    progress = _Progress(pbar_desc, context.num_trajectories or None)

    async def run(item: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> list[TrajectoryGroup]:
        gather_context.set(context)
        is_group = isinstance(item, TrajectoryGroup)
        gather_item.set(None if is_group else id(item))
        before = (len(item.trajectories), len(item.exceptions)) if is_group else (0, 0)
        try:
            group = await item
        except Exception:
            if is_group or not context.allows_one_more_exception():
                raise
            context.num_exceptions += 1  # the coroutine itself failed: drop its group, as ART does
            progress.update([], 1, context.num_trajectories)
            return []
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"gather_trajectory_groups expects TrajectoryGroups, got {type(group).__name__}")
        group = await group  # a coroutine may return a pending group
        progress.update(group.trajectories[before[0]:], len(group.exceptions) - before[1], context.num_trajectories)
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
) -> list[Trajectory | list[Trajectory] | BaseException]:
    """Run rollouts concurrently and return one result per awaitable, in input order (as ART).

    An awaitable that gives a Trajectory gives it; one that gives several (e.g. both players of a
    self-play game) gives them as a list. With `max_exceptions > 0` (a value in (0, 1) is a
    fraction of the awaitables), a failed rollout appears in place as its exception while the
    budget lasts.

    Raises:
        Exception: the failure past `max_exceptions` (with the default 0, the first one).
    """
    items = list(trajectories)
    context = GatherContext(max_exceptions=max_exceptions, num_trajectories=len(items))
    progress = _Progress(pbar_desc, len(items))

    async def run(awaitable: Awaitable[Any]) -> Trajectory | list[Trajectory] | BaseException:
        try:
            result = await awaitable
        except Exception as exc:
            if not context.allows_one_more_exception():
                raise
            context.num_exceptions += 1
            progress.update([], 1)
            return exc
        if isinstance(result, Trajectory):
            progress.update([result], 0)
            return result
        result = list(result)
        progress.update([t for t in result if isinstance(t, Trajectory)], 0)
        return result

    tasks = [asyncio.ensure_future(run(a)) for a in items]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        progress.close()
