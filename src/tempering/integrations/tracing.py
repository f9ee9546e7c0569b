"""Rollouts traced in Weave and Langfuse (extras `tempering[weave]`, `tempering[langfuse]`).

    from tempering.integrations.tracing import trace_rollout

    @trace_rollout
    async def rollout(model, scenario) -> art.Trajectory: ...

Each call of a decorated rollout becomes one trace in each tracing SDK the program set up:

- Weave, once `weave.init(project)` ran: the rollout is a `weave.op` call whose inputs are its
  arguments and whose output is the trajectory as `Trajectory.for_logging()` shows it (messages,
  reward, metrics). Weave's own OpenAI and LangChain integrations, on by default after
  `weave.init`, add the rollout's LLM calls under it. (Decorating with `@weave.op` yourself, as
  ART's examples do, works as well.)
- Langfuse, once the program has a Langfuse client (it built one with `Langfuse(...)`, or set the
  LANGFUSE_PUBLIC_KEY/SECRET_KEY/HOST variables that `langfuse.get_client()` reads): the rollout is a span with the same input and output, its
  reward is a score named "reward" on the trace, and each chat completion it makes through a
  capturing client (`model.openai_client()`, `tempering.langgraph.init_chat_model()`,
  `art.capture_client(...)`) is a generation under it: messages, the reply, sampling options,
  token usage, finish reason and the policy versions that sampled it. (Use this instead of
  `langfuse.openai`, which would log each call twice.)

A rollout whose program set up neither runs untraced, so decorated code runs anywhere. A failed
rollout's span ends with the error (Langfuse level ERROR; Weave's exception field) and the error
propagates. `backends=("weave", "langfuse")` names the SDKs to use instead of detecting them:
a missing package then raises MissingDependencyError naming its extra.

Both SDKs export on background threads; call `weave.finish()` / `langfuse.flush()` before the
program exits.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pydantic import BaseModel

from ..capture import Exchange, listen
from ..errors import ConfigError, MissingDependencyError
from ..model import Model
from ..types import Trajectory

__all__ = ["trace_rollout"]

_BACKENDS = ("weave", "langfuse")
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "seed", "n", "stop", "tool_choice")


def trace_rollout(
    fn: Callable[..., Awaitable[Any]] | None = None,
    *,
    name: str | None = None,
    backends: Iterable[str] | None = None,
) -> Any:
    """Trace each call of an async rollout in Weave and/or Langfuse (see the module doc).

    Args:
        fn: the rollout; `@trace_rollout` or `@trace_rollout(name=..., backends=...)`.
        name: the trace's name (default: the function's name).
        backends: "weave" and/or "langfuse" to trace to; None traces to each SDK the program has
            imported and set up, checked at every call.

    Raises:
        ConfigError: an unknown backend name.
        MissingDependencyError: (when called) a named backend is not installed.
        ConfigError: (when called) Weave is named but `weave.init(...)` has not run.
    """
    if fn is None:
        return functools.partial(trace_rollout, name=name, backends=backends)
    chosen = None if backends is None else tuple(backends)
    unknown = set(chosen or ()) - set(_BACKENDS)
    if unknown:
        raise ConfigError(f"unknown tracing backends {sorted(unknown)}; choose from {list(_BACKENDS)}")
    label = name or fn.__name__
    weave_ops: dict[str, Any] = {}

    @functools.wraps(fn)
    async def in_langfuse(*args: Any, **kwargs: Any) -> Any:
        client = _langfuse_client(chosen)
        if client is None:
            return await fn(*args, **kwargs)
        with client.start_as_current_observation(name=label, as_type="span", input=_inputs(fn, args, kwargs)) as span:
            try:
                with listen(_LangfuseGenerations(client)):
                    result = await fn(*args, **kwargs)
            except Exception as exc:
                span.update(level="ERROR", status_message=f"{type(exc).__name__}: {exc}")
                raise
            if isinstance(result, Trajectory):
                span.update(output=result.for_logging())
                span.score_trace(name="reward", value=float(result.reward))
            return result

    @functools.wraps(fn)
    async def traced(*args: Any, **kwargs: Any) -> Any:
        if not _weave_on(chosen):
            return await in_langfuse(*args, **kwargs)
        if "op" not in weave_ops:
            import weave

            weave_ops["op"] = weave.op(in_langfuse, name=label, postprocess_inputs=_loggable_inputs,
                                       postprocess_output=_for_logging)
        return await weave_ops["op"](*args, **kwargs)

    return traced


def _for_logging(output: Any) -> Any:
    return output.for_logging() if isinstance(output, Trajectory) else output


def _inputs(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except TypeError:
        bound = {"args": list(args), **kwargs}
    return _loggable_inputs(dict(bound))


def _loggable_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The rollout's arguments as a trace shows them: a Model by its name (never its API key)."""
    return {key: _loggable(value) for key, value in inputs.items()}


def _loggable(value: Any) -> Any:
    if isinstance(value, Model):
        return {"model": value.name, "project": value.project}
    if isinstance(value, str | int | float | bool | type(None)):
        return value
    if isinstance(value, list | tuple):
        return [_loggable(v) for v in value]
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return repr(value)


def _require(package: str) -> Any:
    try:
        return __import__(package)
    except ImportError as exc:
        raise MissingDependencyError(f'tracing to {package} needs the {package} package: pip install "tempering[{package}]"') from exc


def _weave_on(chosen: tuple[str, ...] | None) -> bool:
    if chosen is None:
        weave = sys.modules.get("weave")
        return weave is not None and weave.get_client() is not None
    if "weave" not in chosen:
        return False
    if _require("weave").get_client() is None:
        raise ConfigError("tracing to weave needs a Weave client: call weave.init('<entity>/<project>') first")
    return True


def _langfuse_client(chosen: tuple[str, ...] | None) -> Any:
    if chosen is None:
        if sys.modules.get("langfuse") is None or not _langfuse_is_set_up():
            return None
    elif "langfuse" not in chosen:
        return None
    return _require("langfuse").get_client()


def _langfuse_is_set_up() -> bool:
    """Whether `langfuse.get_client()` would return a working client rather than warn and disable one:
    a client was built, or its key is in the environment (the SDK's own rule)."""
    if os.environ.get("LANGFUSE_PUBLIC_KEY"):
        return True
    # the SDK keeps its clients here (langfuse >= 3); no public way to ask without creating one
    from langfuse._client.resource_manager import LangfuseResourceManager

    return bool(LangfuseResourceManager._instances)


class _LangfuseGenerations:
    """A capture listener: one Langfuse generation per chat completion, under the current span."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def on_request(self, request: dict[str, Any]) -> Any:
        return self.client.start_observation(
            name="chat.completions", as_type="generation", model=request.get("model"), input=request.get("messages"),
            model_parameters={k: request[k] for k in _SAMPLING_KEYS if request.get(k) is not None},
            metadata={"tools": [t.get("function", {}).get("name") for t in request.get("tools") or []]},
        )

    def on_response(self, generation: Any, exchange: Exchange | None) -> None:
        if exchange is None:
            generation.update(level="ERROR", status_message="the request failed or its response was not read to the end")
            generation.end()
            return
        choice, usage = exchange.choice, exchange.usage or {}
        num_prompt = len(getattr(choice, "prompt_token_ids", None) or [])  # a stream sends usage only when asked
        num_completion = len(getattr(choice, "token_ids", None) or [])
        generation.update(
            output=choice.message.model_dump(exclude_none=True),
            usage_details={"input": int(usage.get("prompt_tokens", num_prompt)),
                           "output": int(usage.get("completion_tokens", num_completion))},
            metadata={"finish_reason": choice.finish_reason,
                      "policy_versions": sorted(set(getattr(choice, "policy_versions", None) or []))},
        )
        generation.end(end_time=int(exchange.end_s * 1e9))
