"""`limit_concurrency`: at most n concurrent calls of an async function (ART's helper)."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["limit_concurrency"]

F = TypeVar("F", bound=Callable[..., Any])


def limit_concurrency(n: int, derive_key: Callable[..., Hashable] | None = None) -> Callable[[F], F]:
    """Decorator: let at most `n` calls of an async function run at once; the others wait.

    With `derive_key`, the limit applies per key: `derive_key(*args, **kwargs)` (the decorated
    function's arguments) names the pool a call belongs to, e.g. one per judge model or per
    API host. Waiting calls start in arrival order. One decorator applied to several functions
    (`limit = limit_concurrency(4)`, then `@limit` on each) holds them to one shared limit, as
    in ART. Use it on a rollout's external calls (a tool API, a judge) so a large
    `gather_trajectory_groups` does not flood them::

        @art.utils.limit_concurrency(8)
        async def call_search_api(query: str) -> str: ...

    Args:
        n: concurrent calls allowed per key, >= 1.
        derive_key: maps a call's arguments to its key (default: one shared limit).

    Raises:
        ValueError: for n < 1.
        TypeError: if the decorated function is not an async function.
    """
    if n < 1:
        raise ValueError(f"limit_concurrency needs n >= 1, got {n}")
    semaphores: dict[Hashable, asyncio.Semaphore] = {}  # as in ART, shared by every function this decorator wraps

    def decorate(func: F) -> F:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"limit_concurrency decorates async functions; {func.__qualname__} is not one")

        @functools.wraps(func)
        async def run(*args: Any, **kwargs: Any) -> Any:
            key = derive_key(*args, **kwargs) if derive_key is not None else None
            semaphore = semaphores.get(key)
            if semaphore is None:
                semaphore = semaphores[key] = asyncio.Semaphore(n)
            async with semaphore:
                return await func(*args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate
