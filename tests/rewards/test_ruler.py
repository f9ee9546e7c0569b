"""RULER: prompt structure, parsing, the retry, and a real judge served by tempering."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from types import SimpleNamespace

import pytest

import tempering as art
from tempering.rewards import RulerError, ruler, ruler_score_group
from tempering.rewards.ruler import judge_prompt, judge_schema, parse_scores, serves_structured_outputs


def traj(answer, reward):
    return art.Trajectory(messages_and_choices=[
        {"role": "system", "content": "Answer the question."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": answer},
    ], reward=reward)


class ScriptedJudge:
    """An OpenAI-compatible client whose answers are given in advance (RULER's own logic under test)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **kwargs):
        self.requests.append(kwargs)
        text = self.answers.pop(0)
        if isinstance(text, Exception):
            raise text
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))])


def scores(*values):
    return json.dumps({"scores": [{"trajectory_id": str(i + 1), "explanation": "ok", "score": v} for i, v in enumerate(values)]})


def test_the_prompt_sends_the_shared_prefix_once_and_each_trajectory_once():
    lists = [t.messages() for t in (traj("4", 0), traj("5", 0), traj("four", 0))]
    system, user = judge_prompt(lists, "be fair", None)
    assert "be fair" in system["content"] and '"scores"' in system["content"]
    content = user["content"]
    assert content.count("What is 2+2?") == 1 and content.count("<context>") == 1
    for i, answer in enumerate(["4", "5", "four"], start=1):
        assert content.count(f'<trajectory id="{i}">') == 1
        assert json.dumps([{"role": "assistant", "content": answer}]) in content


def test_parse_scores_accepts_good_answers_and_names_every_problem():
    assert [s.score for s in parse_scores("sure: " + scores(0.9, 0.1) + " done", 2)] == [0.9, 0.1]
    for text, problem in [
        ("no json here", "no JSON"),
        ('{"scores": [}', "does not parse"),
        ('{"grades": []}', '"scores"'),
        (scores(0.9), "missing ['2']"),
        (scores(0.9, 1.5), "outside [0, 1]"),
        (json.dumps({"scores": [{"trajectory_id": "1", "score": "high"}, {"trajectory_id": "2", "score": 0}]}), "numeric"),
        (scores(0.1, 0.2, 0.3), "unexpected ['3']"),
    ]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            parse_scores(text, 2)


def test_the_schema_bounds_explanations_only_when_asked_and_the_request_carries_it():
    def explanation(schema):
        return schema["properties"]["scores"]["prefixItems"][0]["properties"]["explanation"]

    assert explanation(judge_schema(2)) == {"type": "string"}
    assert explanation(judge_schema(2, max_explanation_chars=40)) == {"type": "string", "maxLength": 40}
    judge = ScriptedJudge(scores(0.2, 0.8))
    asyncio.run(ruler([traj("4", 0).messages(), traj("5", 0).messages()], judge_model="j", client=judge, structured=True,
                      max_explanation_chars=40))
    sent = judge.requests[0]["response_format"]["json_schema"]["schema"]
    assert explanation(sent)["maxLength"] == 40


def test_a_bad_answer_is_retried_once_with_the_problem_named_then_fails_clearly():
    judge = ScriptedJudge("not json", scores(0.2, 0.8))
    result = asyncio.run(ruler([traj("4", 0).messages(), traj("5", 0).messages()], judge_model="j", client=judge))
    assert [s.score for s in result] == [0.2, 0.8]
    assert "could not be used" in judge.requests[1]["messages"][-1]["content"]
    assert "response_format" not in judge.requests[0]  # not a tempering server: the prompt alone
    judge = ScriptedJudge(scores(0.5), scores(2.0, 0.1))
    with pytest.raises(RulerError, match="outside"):
        asyncio.run(ruler([traj("4", 0).messages(), traj("5", 0).messages()], judge_model="j", client=judge))
    assert len(judge.requests) == 2


def test_a_judge_served_by_tempering_gets_bounded_explanations_and_a_budget_that_holds_them():
    """Unbounded, the default model as judge explained until max_tokens cut its JSON short, twice."""
    from tempering.endpoint import answer_budget
    from tempering.rewards.ruler import TEMPERING_EXPLANATION_CHARS

    async def tempering_models():
        return SimpleNamespace(data=[SimpleNamespace(owned_by="tempering", structured_outputs=True)])

    judge = ScriptedJudge(scores(0.2, 0.8))
    judge.models = SimpleNamespace(list=tempering_models)
    asyncio.run(ruler([traj("4", 0).messages(), traj("5", 0).messages()], judge_model="j", client=judge))
    [request] = judge.requests
    entry = request["response_format"]["json_schema"]["schema"]["properties"]["scores"]["prefixItems"][0]
    assert entry["properties"]["explanation"]["maxLength"] == TEMPERING_EXPLANATION_CHARS
    assert request["max_tokens"] == answer_budget(2, TEMPERING_EXPLANATION_CHARS)


def test_a_judge_request_that_times_out_names_itself_and_the_arguments_to_change():
    import httpx
    import openai

    from tempering.errors import RequestTimeout

    judge = ScriptedJudge(openai.APITimeoutError(request=httpx.Request("POST", "http://judge/v1/chat/completions")))
    with pytest.raises(RequestTimeout, match=r"RULER: the judge's request 1 of at most 2 to 'j' \(scores for 2 "
                                             r"trajectories, max_tokens=1024\) got no answer in [\d.]+ s; "
                                             r"pass a smaller max_tokens or max_explanation_chars"):
        asyncio.run(ruler([traj("4", 0).messages(), traj("5", 0).messages()], judge_model="j", client=judge))


def test_ruler_score_group_keeps_the_independent_reward_and_works_as_after_each():
    judge = ScriptedJudge(scores(1.0, 0.25))

    async def rollout(answer, reward):
        return traj(answer, reward)

    async def main():
        return await art.gather_trajectory_groups(
            [art.TrajectoryGroup([rollout("4", 1.0), rollout("5", 0.0)])], pbar_desc=None,
            after_each=lambda g: ruler_score_group(g, "judge", client=judge))

    [group] = asyncio.run(main())
    by_answer = {t.messages()[-1]["content"]: t for t in group}
    assert sorted(t.reward for t in group) == [0.25, 1.0]
    for t in group:
        assert t.metrics["independent_reward"] in (0.0, 1.0) and t.metrics["ruler_score"] == t.reward
        assert t.logs and t.logs[-1].startswith("RULER:")
    assert by_answer  # both trajectories kept
    bad = ScriptedJudge("?", "??")
    group = art.TrajectoryGroup([traj("4", 1.0), traj("5", 0.0)])
    with pytest.raises(RulerError):
        asyncio.run(ruler_score_group(group, "judge", client=bad))
    assert asyncio.run(ruler_score_group(group, "judge", client=ScriptedJudge("?", "??"), swallow_exceptions=True)) is None


def test_a_judge_served_by_tempering_gets_the_prompt_its_answer_is_checked_and_the_schema_makes_it_score(
        tmp_path, default_model_dir):
    has_grammar = importlib.util.find_spec("llguidance") is not None

    async def main():
        async with art.LocalBackend(path=tmp_path) as backend:
            judge = art.TrainableModel(name="judge", project="tests", base_model="SmolLM2-135M-Instruct")
            await judge.register(backend)
            group = art.TrajectoryGroup([traj("4", 1.0), traj("22", 0.0), traj("four", 1.0)])
            assert await serves_structured_outputs(judge.openai_client()) == has_grammar
            assert not await serves_structured_outputs(ScriptedJudge())
            if has_grammar:  # held to the answer's schema (detected), even a 135M judge scores at once
                scored = await ruler_score_group(group, judge.name, client=judge.openai_client())
                assert len(scored) == 3 and all(0.0 <= t.reward <= 1.0 and t.metrics["ruler_score"] == t.reward for t in scored)
                assert [t.metrics["independent_reward"] for t in scored] == [1.0, 0.0, 1.0]
            try:
                scored = await ruler_score_group(group, judge.name, client=judge.openai_client(), max_tokens=200,
                                                 structured=False)
            except RulerError as error:  # a 135M judge rarely writes valid scores: then it was asked twice
                assert len(error.completions) == 2
                completions = error.completions
            else:
                assert all(0.0 <= t.reward <= 1.0 for t in scored)
                completions = []
            return backend._registry.get("judge").tokenizer, completions

    tokenizer, completions = asyncio.run(main())
    for completion in completions:  # the judge saw the shared prefix once and each trajectory once
        prompt = tokenizer.decode(completion.choices[0].prompt_token_ids)
        assert prompt.count("What is 2+2?") == 1
        assert all(prompt.count(f'<trajectory id="{i}">') == 1 for i in (1, 2, 3))
    if len(completions) == 2:
        retry = tokenizer.decode(completions[1].choices[0].prompt_token_ids)
        assert "could not be used" in retry


# ---- ART's call forms: a judge named by provider, reached through LiteLLM ------------------------------


def group_of_three():
    return art.TrajectoryGroup([traj("4", 1.0), traj("22", 0.0), traj("four", 1.0)])


@pytest.fixture(scope="module")
def local_judge():
    """The default model served by tempering (inference only) as "judge", behind a key: (base URL, key)."""
    from tempering.service import create_app
    from tempering.service.adapter_server import AdapterServer
    from tempering.service.server import ServerThread

    server = AdapterServer("SmolLM2-135M-Instruct", base_name="judge", device="cpu")
    thread = ServerThread(create_app(server, api_key="judge-key"))
    thread.start()
    try:
        yield f"{thread.base_url}/v1", "judge-key"
    finally:
        thread.stop()
        server.close()


def test_arts_call_forms_reach_a_local_judge_served_by_tempering_through_litellm(local_judge):
    """ART's docs for a local judge: judge_model="openai/<name>", extra_litellm_params={"api_base", "api_key"}."""
    api_base, key = local_judge
    params = {"api_base": api_base, "api_key": key}

    async def main():
        scored = await ruler_score_group(group_of_three(), "openai/judge", extra_litellm_params=params)
        positional = await ruler_score_group(group_of_three(), "hosted_vllm/judge", params, swallow_exceptions=True)
        scores = await ruler([t.messages() for t in group_of_three()], "openai/judge", params)
        return scored, positional, scores

    scored, positional, scores = asyncio.run(main())
    for group in (scored, positional):  # held to the answer's schema (a tempering server, detected), even 135M scores
        assert len(group) == 3 and all(0.0 <= t.reward <= 1.0 and t.metrics["ruler_score"] == t.reward for t in group)
        assert [t.metrics["independent_reward"] for t in group] == [1.0, 0.0, 1.0]
        assert group.metrics["ruler_prompt_tokens"] > 100 and group.metrics["ruler_completion_tokens"] > 10
        assert "costs/judge/ruler" not in group.metrics  # a local model has no price
    assert len(scores) == 3


def test_other_providers_go_through_litellm_their_usage_and_known_cost_reach_the_steps_metrics():
    """LiteLLM's own offline hook (`mock_response`) stands in for the providers' APIs."""
    from tempering.types import summarize_groups

    answer = scores(0.9, 0.1, 0.5)

    async def main():
        priced = await ruler_score_group(group_of_three(), "openai/gpt-4o-mini", {"mock_response": answer})
        others = [await ruler_score_group(group_of_three(), name, {"mock_response": answer})
                  for name in ("anthropic/claude-sonnet-4-20250514", "openrouter/openai/o4-mini")]
        with pytest.raises(RulerError, match="could not be used twice") as bad:
            await ruler_score_group(group_of_three(), "openai/o4-mini", {"mock_response": "no json"})
        return priced, others, bad.value

    priced, others, bad = asyncio.run(main())
    for group in (priced, *others):
        assert [t.reward for t in group] == [0.9, 0.1, 0.5]
        assert group.metrics["ruler_prompt_tokens"] > 0 and group.metrics["ruler_completion_tokens"] > 0
    cost = priced.metrics["costs/judge/ruler"]  # LiteLLM knows gpt-4o-mini's price
    assert cost > 0 and len(bad.completions) == 2
    row = summarize_groups([priced, priced], split="train")  # a step of two such groups
    assert row["costs/train/judge/ruler"] == row["costs/train/judge"] == row["costs/train"] == row["costs/all"] \
        == pytest.approx(2 * cost)
    assert row["train/group_ruler_prompt_tokens"] == priced.metrics["ruler_prompt_tokens"]  # ART's mean per group


def test_extra_litellm_params_with_a_client_are_refused_and_without_litellm_the_error_names_the_extra():
    import subprocess
    import sys

    with pytest.raises(art.ConfigError, match="pass one or the other"):
        asyncio.run(ruler([traj("4", 0).messages()], "judge", {"api_base": "x"}, client=ScriptedJudge(scores(1.0))))
    script = (
        "import sys; sys.modules['litellm'] = None\n"  # as if LiteLLM were not installed
        "import asyncio, json, types\n"
        "from tempering.errors import MissingDependencyError\n"
        "from tempering.rewards import ruler\n"
        "messages = [[{'role': 'user', 'content': 'hi'}]]\n"
        "try:\n"
        "    asyncio.run(ruler(messages, 'openai/o4-mini'))\n"
        "except MissingDependencyError as error:\n"
        "    print(error)\n"
        "answer = json.dumps({'scores': [{'trajectory_id': '1', 'explanation': '', 'score': 0.5}]})\n"
        "async def create(**request):\n"
        "    return types.SimpleNamespace(choices=[types.SimpleNamespace(message=types.SimpleNamespace(content=answer))])\n"
        "client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=types.SimpleNamespace(create=create)))\n"
        "print('client:', asyncio.run(ruler(messages, 'judge', client=client))[0].score)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "pip install 'tempering[ruler]'" in out.stdout and "client: 0.5" in out.stdout, out.stdout + out.stderr
