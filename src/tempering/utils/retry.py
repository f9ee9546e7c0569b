"""`retry`: call a function again when it raises one of the given exceptions (ART's `art.retry`)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ConfigError

__all__ = ["retry"]

F = TypeVar("F", bound=Callable[..., Any])


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], Any] | None = None,
) -> Callable[[F], F]:
    """Decorator: retry a sync or async function when it raises one of `exceptions`.

    The function is called up to `max_attempts` times. After failed attempt k (1-based) the
    wrapper calls `on_retry(exception, k)` (awaited if it returns an awaitable), then waits
    `delay * backoff_factor ** (k - 1)` seconds (asyncio.sleep for async functions, so other
    rollouts keep running). Other exceptions propagate at once; after the last attempt the last
    exception is raised unchanged. Typical use, as in ART's examples::

        @art.retry(exceptions=(openai.LengthFinishReasonError,))
        async def rollout(model, scenario) -> art.Trajectory: ...

    Args:
        max_attempts: total calls, >= 1.
        delay: seconds before the second attempt, >= 0.
        backoff_factor: multiplier of the delay after each failed attempt, >= 0 (as in ART, a
            factor below 1 shortens the waits: 0.5 halves each one).
        exceptions: an exception class or a tuple of them.
        on_retry: called with (exception, attempt number) before each new attempt.

    Raises:
        ConfigError (a ValueError): for max_attempts < 1, delay < 0 or backoff_factor < 0.
    """
    problems = [f"{name} must be {bound}, got {value!r}" for name, value, bound, ok in (
        ("max_attempts", max_attempts, ">= 1 (the first call counts)", max_attempts >= 1),
        ("delay", delay, ">= 0 seconds", delay >= 0),
        ("backoff_factor", backoff_factor, ">= 0 (it multiplies the delay after each failed attempt)",
         backoff_factor >= 0),
    ) if not ok]
    if problems:
        raise ConfigError(f"retry: {'; '.join(problems)}")

    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await func(*args, **kwargs)
                    except exceptions as exc:
                        if attempt == max_attempts:
                            raise
                        if on_retry is not None and inspect.isawaitable(result := on_retry(exc, attempt)):
                            await result
                        await asyncio.sleep(delay * backoff_factor ** (attempt - 1))
                raise AssertionError("unreachable")

            return run_async  # type: ignore[return-value]

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, max_attempts + 1):
                try:
                    return func(*args, **kwargs)
                except exceptions as exc:
                    if attempt == max_attempts:
                        raise
                    if on_retry is not None:
                        on_retry(exc, attempt)
                    time.sleep(delay * backoff_factor ** (attempt - 1))
            raise AssertionError("unreachable")

        return run  # type: ignore[return-value]

    return decorate
