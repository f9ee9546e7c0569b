"""tempering.langgraph: a LangGraph ReAct agent on the default model, captured call by call, trained one step."""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Literal

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import ToolNode, create_react_agent

import tempering as art
from tempering.capture import listen
from tempering.langgraph import init_chat_model, wrap_rollout
from tempering.training.tokenize import tokenize_trajectory
from tempering.types import Choice


@tool
def capital_of(country: Literal["France", "Italy"]) -> str:
    """The capital city of a country."""
    return {"France": "Paris", "Italy": "Rome"}[country]


@tool
def weather_in(city: Literal["Paris", "Rome"]) -> str:
    """Today's weather in a city."""
    return {"Paris": "rainy", "Rome": "sunny"}[city]


@tool("capital_of")
def broken_capital_of(country: Literal["France", "Italy"]) -> str:
    """The capital city of a country."""
    raise RuntimeError("the geography service is down")


QUESTION = [("system", "Use the tools."), ("user", "What is the weather in the capital of France?")]


def react_agent(tools, forced: tuple[str, ...], **chat_options):
    """create_react_agent whose model must call `forced` tools in turn (SmolLM2 rarely calls one unasked), then answers."""
    chat = init_chat_model(**chat_options)

    def pick_model(state, runtime):
        done = sum(isinstance(m, ToolMessage) for m in state["messages"])
        choice = forced[done] if done < len(forced) else "none"
        return chat.bind_tools(tools, tool_choice=choice, strict=True)

    return create_react_agent(pick_model, ToolNode(tools, handle_tool_errors=False))


async def rollout(seed: int, *, stream: bool = False, tools=(capital_of, weather_in), forced=("capital_of", "weather_in"),
                  max_tokens: int = 32):
    agent = react_agent(list(tools), forced, seed=seed, max_tokens=max_tokens)
    if stream:  # LangChain streams the model's tokens: captured from the server-sent events
        state = None
        async for mode, chunk in agent.astream({"messages": QUESTION}, stream_mode=["messages", "values"]):
            state = chunk if mode == "values" else state
    else:
        state = await agent.ainvoke({"messages": QUESTION})
    answer = state["messages"][-1].content
    return art.Trajectory(messages_and_choices=[], reward=len(answer), metadata={"seed": seed})


class StreamFlags:
    """A capture listener noting whether each finished chat completion was streamed."""

    def __init__(self) -> None:
        self.flags: list[bool] = []

    def on_request(self, request):
        return bool(request.get("stream"))

    def on_response(self, is_stream, exchange):
        if exchange is not None:
            self.flags.append(is_stream)


def run(served, coro):
    return served[2].run_until_complete(coro)


def test_a_react_agent_with_two_tools_is_captured_call_by_call_and_trains_one_step(served):
    model, backend, _ = served
    wrapped = wrap_rollout(model, rollout)
    seen = StreamFlags()
    with listen(seen):
        groups = run(served, art.gather_trajectory_groups(
            [art.TrajectoryGroup([wrapped(0), wrapped(1, stream=True)])], pbar_desc=None))
    assert sorted(seen.flags) == [False] * 3 + [True] * 3
    service = backend._registry.get(model.name)
    for traj in groups[0]:
        items = traj.messages_and_choices
        assert [m.message.role if isinstance(m, Choice) else m["role"] for m in items] == [
            "system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        choices = [m for m in items if isinstance(m, Choice)]
        assert [[c.function.name for c in ch.message.tool_calls or []] for ch in choices] == [["capital_of"], ["weather_in"], []]
        assert items[3]["content"] == "Paris" and items[5]["content"] == "rainy"
        assert [t["function"]["name"] for t in traj.tools] == ["capital_of", "weather_in"] and not traj.additional_histories
        for c in choices:
            assert len(c.token_ids) == len(c.sampled_logprobs) > 0 and c.logprobs is None
        [seq] = tokenize_trajectory(traj, service.renderer, max_seq_len=service.max_seq_len)  # the three calls are one sequence
        assert [t for t, m in zip(seq.token_ids, seq.loss_mask) if m] == [t for c in choices for t in c.token_ids]
    assert len({t.reward for t in groups[0]}) == 2  # the rewards differ: the group trains

    step = run(served, model.get_step())  # the served model is shared: other files' tests may have trained it
    result = run(served, model.train(groups, config=art.TrainConfig(learning_rate=1e-4, gradient_checkpointing=False)))
    assert result.step == step + 1 and result.num_groups_trainable == 1
    after = run(served, model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2))
    assert set(after.choices[0].policy_versions) == {step + 1}


def test_an_agent_that_raises_fails_its_rollout_within_max_exceptions_and_the_server_keeps_serving(served):
    model, _, _ = served

    def group():
        broken = wrap_rollout(model, rollout)(0, tools=(broken_capital_of, weather_in), forced=("capital_of",))
        fine = wrap_rollout(model, rollout)(1, forced=(), max_tokens=4)  # answers at once
        return art.TrajectoryGroup([broken, fine])

    [result] = run(served, art.gather_trajectory_groups([group()], max_exceptions=1, pbar_desc=None))
    assert len(result.trajectories) == 1 and len(result.exceptions) == 1
    error = result.exceptions[0]
    assert error.type == "RuntimeError" and "geography service is down" in error.message
    assert "after 1 captured LLM calls" in error.traceback
    with pytest.raises(RuntimeError, match="geography"):
        run(served, art.gather_trajectory_groups([group()], pbar_desc=None))
    [fine] = run(served, art.gather_trajectory_groups([art.TrajectoryGroup([wrap_rollout(model, rollout)(2, forced=(), max_tokens=4)])],
                                                      pbar_desc=None))[0]
    assert [type(m) for m in fine.messages_and_choices][-1] is Choice


def test_init_chat_model_serves_the_rollouts_model_and_misuse_gets_clear_errors(served, caplog):
    model, _, _ = served
    with pytest.raises(art.ConfigError, match="wrap_rollout"):
        init_chat_model(model.name)

    @wrap_rollout(model)
    async def decorated() -> None:  # returns None: the captured trajectory comes back, scored through auto_trajectory
        reply = await init_chat_model(max_tokens=3, temperature=0).ainvoke("Hi")
        art.auto_trajectory(required=True).reward = float(len(reply.content))

    traj = run(served, decorated())
    [choice] = [m for m in traj.messages_and_choices if isinstance(m, Choice)]
    assert traj.reward == len(choice.message.content) and choice.token_ids and "duration" in traj.metrics

    outside = init_chat_model(model, max_tokens=3)  # a Model works outside a rollout too; captured in any scope
    captured = run(served, art.capture_auto_trajectory(outside.ainvoke("Hi")))
    assert len([m for m in captured.messages_and_choices if isinstance(m, Choice)]) == 1

    async def uncaptured():  # LangChain's own client: tempering never sees the call
        plain = ChatOpenAI(model=model.name, base_url=model.inference_base_url, api_key=model.inference_api_key, max_tokens=2)
        await plain.ainvoke("Hi")
        return art.Trajectory(messages_and_choices=[], reward=1.0)

    with caplog.at_level(logging.WARNING, logger="tempering"):  # as ART: the rollout's own trajectory, unchanged
        returned = run(served, wrap_rollout(model, uncaptured)())
    assert returned.messages_and_choices == [] and returned.reward == 1.0
    assert "init_chat_model" in caplog.text

    async def wrong():
        return {"reward": 1.0}

    with pytest.raises(TypeError, match="Trajectory or None"):
        run(served, wrap_rollout(model, wrong)())


def test_without_the_extra_the_import_error_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "langchain_openai", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "tempering.langgraph", raising=False)
    monkeypatch.delitem(sys.modules, "tempering.integrations.langgraph", raising=False)
    with pytest.raises(ImportError, match=r'pip install "tempering\[langgraph\]"') as info:
        importlib.import_module("tempering.langgraph")
    assert isinstance(info.value, art.MissingDependencyError)
