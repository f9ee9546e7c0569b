"""LangGraph agents as rollouts (ART's `art.langgraph`; extra `tempering[langgraph]`).

    from tempering.langgraph import init_chat_model, wrap_rollout

    async def rollout(model, scenario) -> art.Trajectory:
        agent = create_react_agent(init_chat_model(model.name), tools)
        await agent.ainvoke({"messages": [("user", scenario)]})
        return art.Trajectory(messages_and_choices=[], reward=score(...))

    group = art.TrajectoryGroup(wrap_rollout(model, rollout)(model, s) for _ in range(8))

`init_chat_model()` is a LangChain `ChatOpenAI` served by the model being trained, so tool
calling, structured output, streaming and retries work as LangChain documents them. Its
requests go through tempering's capturing transport, and `wrap_rollout` runs the rollout in a
capture scope (tempering.capture), so the returned trajectory holds every LLM call of the graph
in order, each as the server's `Choice` with its token ids and logprobs: trainable as is. (ART
logs LangChain messages to files and rebuilds choices from them afterwards.)
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..capture import capture_scope, capturing_http_client, capturing_sync_http_client
from ..capture.transport import httpx  # the openai SDK's HTTP library: httpx2 under openai >= 3
from ..errors import ConfigError, MissingDependencyError, TrajectoryError
from ..model import Model
from ..types import Choice, Trajectory

try:
    from langchain_openai import ChatOpenAI
except ImportError as exc:
    raise MissingDependencyError(
        'tempering.langgraph needs LangGraph and LangChain\'s OpenAI models: pip install "tempering[langgraph]"'
    ) from exc

__all__ = ["init_chat_model", "wrap_rollout"]

log = logging.getLogger("tempering")

_rollout_model: contextvars.ContextVar[Model | None] = contextvars.ContextVar("tempering_langgraph_model", default=None)

Rollout = Callable[..., Awaitable[Trajectory | None]]


def init_chat_model(
    model: str | Model | None = None,
    *,
    model_provider: str | None = None,
    configurable_fields: Any = None,
    config_prefix: str | None = None,
    **kwargs: Any,
) -> ChatOpenAI:
    """A LangChain chat model served by the model being trained (ART's `init_chat_model`).

    Args:
        model: inside a `wrap_rollout` rollout, the name requests use (default: the rollout
            model's latest policy; `model.get_inference_name(step)` names a saved step). Outside
            one, pass the `Model` itself.
        kwargs: `ChatOpenAI` options (max_tokens, seed, streaming, ...); temperature defaults
            to 1.0, sampling the policy as RL needs.
        model_provider, configurable_fields, config_prefix: LangChain's arguments, accepted and
            ignored (the provider is always the tempering server).

    Returns:
        a `langchain_openai.ChatOpenAI` whose chat completions are captured by the enclosing
        `wrap_rollout` (or `art.capture_auto_trajectory`).

    Raises:
        ConfigError: called outside a `wrap_rollout` rollout without a `Model`.
        BackendError: the model has no endpoint (not registered).
    """
    target = model if isinstance(model, Model) else _rollout_model.get()
    if target is None:
        raise ConfigError(
            "init_chat_model() does not know which model to serve: call it inside a rollout wrapped with "
            "tempering.langgraph.wrap_rollout(model, rollout), or pass the model: init_chat_model(model)"
        )
    client = target.openai_client()  # raises BackendError naming the fix when the model has no endpoint
    name = model if isinstance(model, str) else target.get_inference_name()
    options: dict[str, Any] = {"temperature": 1.0, **kwargs}
    return ChatOpenAI(
        model=name,
        base_url=target.inference_base_url,
        api_key=target.inference_api_key or "none",
        http_async_client=_pooled_http_client(client),
        http_client=_shared_sync_http_client(),
        **options,
    )


def _pooled_http_client(client: Any) -> Any:
    """The model's own capturing HTTP client (`model.openai_client()`'s), so that the chat models of
    every rollout share its connection pool: a new client per `init_chat_model()` call (ART's code
    makes one per rollout) opened a connection per LLM call, hundreds at once, and cost ~0.1 s each."""
    http_client = getattr(client, "_client", None)  # the openai SDK keeps its httpx client there
    return http_client if isinstance(http_client, httpx.AsyncClient) else capturing_http_client()


@functools.cache
def _shared_sync_http_client() -> Any:
    """One capturing client for every chat model's synchronous calls (a sync client serves any thread)."""
    return capturing_sync_http_client()


def wrap_rollout(model: Model, fn: Rollout | None = None) -> Any:
    """Run an async LangGraph rollout of `model` and return its captured `Trajectory`.

    `wrap_rollout(model, fn)(*args, **kwargs)` (ART's form) or `@wrap_rollout(model)`. Inside,
    `init_chat_model()` serves `model`, and every chat completion made through a capturing
    client (init_chat_model's, `model.openai_client()`, `art.capture_client(...)`) is recorded,
    in order: one conversation per line of messages, the first as the trajectory's main one and
    the others (sub-agents, a second prompt) as `additional_histories`.

    `fn` returns the Trajectory it scored (reward, metrics, metadata; its conversation is
    replaced by the captured one), or None: then the captured trajectory is returned, with the
    reward set through `art.auto_trajectory().reward`. When no LLM call was captured, the
    Trajectory `fn` returned comes back unchanged, as ART's does, with a warning logged if it
    holds no `Choice` (the agent used a model tempering does not see: build it with
    `init_chat_model()`); training on it then fails, naming the missing choice.

    Raises:
        Exception: whatever `fn` raises (the agent failed: the rollout fails, and
            `gather_trajectory_groups(max_exceptions=...)` counts it), with a note of how many LLM
            calls had been captured.
        TypeError: `fn` returned something other than a Trajectory or None.
        TrajectoryError: `fn` returned None and no LLM call was captured (there is no trajectory
            to return).
    """
    if fn is None:
        return functools.partial(wrap_rollout, model)

    @functools.wraps(fn)
    async def rollout(*args: Any, **kwargs: Any) -> Trajectory:
        token = _rollout_model.set(model)
        try:
            with capture_scope() as scope:
                try:
                    result = await fn(*args, **kwargs)
                except Exception as exc:
                    exc.add_note(f"(raised in a LangGraph rollout after {scope.num_calls} captured LLM calls)")
                    raise
        finally:
            _rollout_model.reset(token)
        captured = scope.trajectory
        if result is not None and not isinstance(result, Trajectory):
            raise TypeError(f"a wrap_rollout rollout must return an art.Trajectory or None, got {type(result).__name__}")
        if result is None:
            trajectory = captured.finish()
        else:
            trajectory = result
            if scope.num_calls:
                trajectory.messages_and_choices = captured.messages_and_choices
                trajectory.tools = captured.tools
                trajectory.additional_histories = captured.additional_histories
        if not any(isinstance(item, Choice) for h in trajectory.histories() for item in h.messages_and_choices):
            if result is None:
                raise TrajectoryError(
                    "the rollout returned None and made no LLM call that tempering could capture, so there is no "
                    "trajectory: build the agent's chat model with tempering.langgraph.init_chat_model() (or wrap an "
                    "openai client with art.capture_client)"
                )
            log.warning("wrap_rollout(%s): the rollout made no LLM call that tempering could capture, so its trajectory "
                        "is returned as it is, with no Choice to train on; build the agent's chat model with "
                        "tempering.langgraph.init_chat_model() (or wrap an openai client with art.capture_client)",
                        getattr(fn, "__qualname__", fn))
        return trajectory

    return rollout
