"""Automatic trajectory capture through the real openai client and the real server (default model)."""

from __future__ import annotations

import asyncio

import openai
import pytest

import tempering as art
from tempering.capture import capture_scope
from tempering.training.tokenize import tokenize_trajectory
from tempering.types import Choice

TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The current time.",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def served(serve_default_model):
    with serve_default_model("capture-test") as served:
        yield served

def run(served, coro):
    return served[2].run_until_complete(coro)


def choices_of(history) -> list[Choice]:
    return [m for m in history.messages_and_choices if isinstance(m, Choice)]


def test_a_multi_turn_rollout_is_captured_in_order_and_trains_on_exactly_the_sampled_tokens(served):
    model, backend, _ = served
    client = model.openai_client()

    async def rollout():
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
        first = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, seed=1)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Another?"}]
        await client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, seed=2)
        art.auto_trajectory(required=True).reward = 0.5
        return "ignored"

    traj = run(served, art.capture_auto_trajectory(rollout()))
    assert traj.reward == 0.5 and "duration" in traj.metrics and traj.additional_histories == []
    roles = [m.message.role if isinstance(m, Choice) else m["role"] for m in traj.messages_and_choices]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    first, second = choices_of(traj)
    assert isinstance(traj.messages_and_choices[2], Choice) and isinstance(traj.messages_and_choices[4], Choice)
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.token_ids)] == first.prompt_token_ids + first.token_ids
    service = backend._registry.get(model.name)
    [seq] = tokenize_trajectory(traj, service.renderer, max_seq_len=service.max_seq_len)  # turns merged into one sequence
    assert [t for t, m in zip(seq.token_ids, seq.loss_mask) if m] == first.token_ids + second.token_ids
    assert [lp for lp, m in zip(seq.sampled_logprobs, seq.loss_mask) if m] == [
        lp for c in (first, second) for lp in c.sampled_logprobs]


def test_a_streamed_completion_is_captured_with_the_tokens_and_logprobs_of_the_same_request_unstreamed(served):
    model, _, _ = served
    client = model.openai_client()
    kwargs = {"model": model.name, "messages": [{"role": "user", "content": "Tell me a short story."}], "max_tokens": 12,
              "temperature": 1.0, "seed": 11}

    async def streamed():
        stream = await client.chat.completions.create(stream=True, **kwargs)
        async for _ in stream:
            pass

    # the prompt's KV blocks cached first, so both requests prefill the same uncached suffix (a
    # whole-prompt prefill rounds the logprobs ~1e-6 differently)
    run(served, client.chat.completions.create(**{**kwargs, "max_tokens": 1}))
    traj = run(served, art.capture_auto_trajectory(streamed()))
    full = run(served, client.chat.completions.create(**kwargs)).choices[0]
    [captured] = choices_of(traj)
    assert captured.token_ids == full.token_ids and captured.prompt_token_ids == full.prompt_token_ids
    assert captured.sampled_logprobs == full.sampled_logprobs
    assert captured.logprobs is None  # not asked for: OpenAI's per-token objects are not sent
    assert captured.message.content == full.message.content and captured.finish_reason == full.finish_reason
    assert captured.policy_versions == full.policy_versions and captured.logprob_temperature == full.logprob_temperature


def test_a_streamed_tool_call_is_captured_with_its_tools(served):
    model, _, _ = served
    client = model.openai_client()
    kwargs = {"model": model.name, "messages": [{"role": "user", "content": "What time is it?"}], "tools": TOOLS,
              "tool_choice": "required", "max_tokens": 24, "seed": 3}

    async def streamed():
        async for _ in await client.chat.completions.create(stream=True, **kwargs):
            pass

    # the prompt's KV blocks cached first, so both requests prefill the same uncached suffix (a
    # whole-prompt prefill rounds the logprobs ~1e-6 differently)
    run(served, client.chat.completions.create(**{**kwargs, "max_tokens": 1}))
    traj = run(served, art.capture_auto_trajectory(streamed()))
    full = run(served, client.chat.completions.create(**kwargs)).choices[0]
    [captured] = choices_of(traj)
    assert traj.tools == TOOLS
    assert captured.token_ids == full.token_ids
    got = [(c.function.name, c.function.arguments) for c in captured.message.tool_calls or []]
    assert got == [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]


def test_a_request_that_does_not_extend_the_conversation_starts_an_additional_history(served):
    model, _, _ = served
    client = model.openai_client()

    async def rollout():
        main = [{"role": "user", "content": "Say hi."}]
        reply = await client.chat.completions.create(model=model.name, messages=main, max_tokens=4, seed=1)
        await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Summarize: hi."}], max_tokens=4)
        # the framework sends the assistant turn back re-serialized (content None would be "" too): still the same conversation
        main += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Again."}]
        await client.chat.completions.create(model=model.name, messages=main, max_tokens=4)
        await client.chat.completions.create(model=model.name, messages=main[:1], max_tokens=4)  # a second sample of turn 1

    traj = run(served, art.capture_auto_trajectory(rollout()))
    assert len(choices_of(traj)) == 2 and traj.messages()[-2]["content"] == "Again."
    assert [len(choices_of(h)) for h in traj.additional_histories] == [1, 1]
    assert traj.additional_histories[0].messages()[0]["content"] == "Summarize: hi."


def test_only_capturing_clients_are_captured_and_any_openai_client_can_be_wrapped(served):
    model, _, _ = served
    own = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    sync = openai.OpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    kwargs = {"model": model.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

    async def rollout():
        await own.chat.completions.create(**kwargs)  # not captured: a plain client
        await art.capture_client(own).chat.completions.create(**kwargs)
        # a sync client in a worker thread: the thread runs in a copy of this context
        await asyncio.to_thread(lambda: art.capture_client(sync).chat.completions.create(**kwargs))

    traj = run(served, art.capture_auto_trajectory(rollout()))
    assert len(choices_of(traj)) == 1 and len(traj.additional_histories) == 1
    assert all(c.token_ids for h in traj.histories() for c in choices_of(h))
    with pytest.raises(TypeError, match="openai"):
        art.capture_client(object())


def test_outside_a_capture_nothing_is_recorded_and_inner_scopes_take_their_calls(served):
    model, _, _ = served
    client = model.openai_client()
    kwargs = {"model": model.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    assert art.auto_trajectory() is None
    with pytest.raises(art.TrajectoryError, match="capture_auto_trajectory"):
        art.auto_trajectory(required=True)

    async def rollout():
        await client.chat.completions.create(**kwargs)
        inner = await art.capture_auto_trajectory(client.chat.completions.create(**kwargs))
        assert len(choices_of(inner)) == 1

    run(served, client.chat.completions.create(**kwargs))
    with capture_scope() as outer:
        run(served, rollout())
    assert outer.num_calls == 1 and len(choices_of(outer.trajectory)) == 1


def test_a_failing_rollout_counts_against_max_exceptions_and_the_server_keeps_serving(served):
    model, _, _ = served
    client = model.openai_client()
    kwargs = {"model": model.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

    async def rollout(fail: bool):
        await client.chat.completions.create(**kwargs)
        if fail:
            raise ValueError("the environment broke")
        art.auto_trajectory(required=True).reward = 1.0

    async def gather(max_exceptions):
        return await art.gather_trajectory_groups(
            [art.TrajectoryGroup(art.capture_auto_trajectory(rollout(fail=i == 0)) for i in range(2))],
            max_exceptions=max_exceptions, pbar_desc=None)

    [group] = run(served, gather(1))
    assert len(group.trajectories) == 1 and len(group.exceptions) == 1
    assert group.exceptions[0].type == "ValueError" and "after 1 chat completions" in group.exceptions[0].traceback
    with pytest.raises(ValueError, match="the environment broke"):
        run(served, gather(0))
    assert run(served, client.chat.completions.create(**kwargs)).choices[0].token_ids  # still serving


class Outcomes:
    """A capture listener noting, per request, whether it finished with a choice."""

    def __init__(self) -> None:
        self.finished: list[bool] = []

    def on_request(self, request):
        return request["messages"][-1]["content"]

    def on_response(self, content, exchange):
        self.finished.append(exchange is not None and exchange.request["messages"][-1]["content"] == content)


def test_failed_and_abandoned_requests_are_not_recorded_but_their_listeners_are_told(served):
    model, _, _ = served
    client = model.openai_client()
    outcomes = Outcomes()

    async def rollout():
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "a"}])
        stream = await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "b"}],
                                                      max_tokens=16, stream=True)
        async for _ in stream:
            break  # abandoned after the first chunk
        await stream.close()
        await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "c"}], max_tokens=2)

    with art.capture.listen(outcomes):
        traj = run(served, art.capture_auto_trajectory(rollout()))
    assert outcomes.finished == [False, False, True]
    assert [m["content"] for m in traj.messages()] == ["c", traj.messages()[1]["content"]] and len(choices_of(traj)) == 1


def test_the_capturing_client_is_built_on_the_openai_sdks_own_http_library():
    """openai >= 3 is built on httpx2, whose connection pool stays fast under a burst of concurrent
    rollouts (httpx 0.28's rescans every connection per queued request); older SDKs take httpx only."""
    from importlib.metadata import version

    from tempering.capture import capturing_http_client

    client = capturing_http_client()
    if int(version("openai").split(".")[0]) >= 3:
        import httpx2

        assert isinstance(client, httpx2.AsyncClient)
    else:
        import httpx

        assert isinstance(client, httpx.AsyncClient)
