"""RULER: score the trajectories of a group relative to each other with an LLM judge.

The judge is named as ART names it, `ruler_score_group(group, "openai/o4-mini",
extra_litellm_params={...})`, and reached through LiteLLM (the `ruler` extra): any provider
LiteLLM knows ("openai/", "anthropic/", "openrouter/", "hosted_vllm/", ...), or a local
OpenAI-compatible server (`"openai/<name>"` with `extra_litellm_params={"api_base": ...,
"api_key": ...}`), such as a tempering server. Or it is any OpenAI-compatible client
(`client=`, e.g. `model.openai_client()`; or `base_url`/`api_key`), which takes the judge's name
as the endpoint knows it and needs no LiteLLM. The prompt sends the messages all trajectories share once, inside
`<context>`, then each trajectory's own messages once, inside `<trajectory id="i">`, and asks for
`{"scores": [{"trajectory_id": "1", "explanation": "...", "score": 0.8}, ...]}` with scores in
[0, 1]. An answer that does not parse, misses or repeats an id, or gives a score outside [0, 1]
is sent back to the judge once with the problem named; a second bad answer raises RulerError.
Nothing is silently dropped. (After ART's RULER, described in reference/ART.md section 4; wording
and code ours.)

A judge served by tempering (its `/v1/models` says `owned_by: "tempering"` and
`structured_outputs: true`) is also sent `response_format` with the answer's JSON schema
(`judge_schema`: one entry per trajectory id, in order, scores in [0, 1]), so even a small local
judge answers in a form that parses; other endpoints get only the prompt. A tempering-served
judge's explanations are bounded (`TEMPERING_EXPLANATION_CHARS` unless `max_explanation_chars`
says otherwise) and `max_tokens` holds the whole answer, so a small judge on a CPU finishes with
JSON that parses instead of explaining until the budget cuts it off.

`ruler_score_group` records what the judge used on the group it returns, for the step's metrics:
`metrics["ruler_prompt_tokens"]` and `["ruler_completion_tokens"]` (every request, a retry's
included), and `metrics["costs/judge/ruler"]`, in USD, when LiteLLM knows the judge's price.
A step's history row then holds `<split>/group_ruler_prompt_tokens` (the mean per group, as ART
averages group metrics) and ART's `costs/<split>/judge/ruler` (summed over the groups; see
`types.summarize_groups`).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

from ..endpoint import answer_budget, create_completion, describe_endpoint, without_retries
from ..errors import ConfigError, TemperingError
from ..types import TrajectoryGroup
from .litellm_judge import LiteLLMJudge

__all__ = ["DEFAULT_RUBRIC", "TEMPERING_EXPLANATION_CHARS", "RulerError", "TrajectoryScore", "judge_schema",
           "parse_scores", "ruler", "ruler_score_group", "serves_structured_outputs"]

log = logging.getLogger("tempering")

EXTERNAL_MAX_TOKENS = 1024  # the judge's budget at an external API reached by client= (the schema is not sent there)
DEFAULT_JUDGE = "openai/o3"  # ART's default judge_model

TEMPERING_EXPLANATION_CHARS = 160
"""Each explanation's length bound for a judge served by tempering when `max_explanation_chars` is
not given: a sentence or two. Unbounded, the default model as judge often explained until
`max_tokens` cut its JSON short, twice (the retry), and the group was lost."""

DEFAULT_RUBRIC = """\
- A trajectory that reaches its goal scores clearly higher than one that does not.
- Between two trajectories that reach the goal, the one that gets there more directly (fewer detours, \
fewer wasted steps) scores higher.
- Make score differences proportional to differences in quality: close trajectories get close scores.
- Give partial credit to a trajectory that makes real progress without finishing."""

_SYSTEM = """\
You judge attempts by an AI agent. All the trajectories below were given the same task; compare \
them with each other and give each a score between 0 and 1.

Grading standards:
{rubric}

Answer with one JSON object and nothing else, in this form:
{{"scores": [{{"trajectory_id": "1", "explanation": "one sentence", "score": 0.5}}, ...]}}
with exactly one entry for each trajectory id, in order."""


class RulerError(TemperingError, ValueError):
    """The judge's answer could not be used (after one retry). `completions` holds its answers."""

    def __init__(self, message: str, completions: list[Any] | None = None) -> None:
        super().__init__(message)
        self.completions = completions or []


@dataclass(slots=True)
class TrajectoryScore:
    trajectory_id: str
    score: float
    explanation: str


def _common_prefix(message_lists: list[list[dict[str, Any]]]) -> int:
    n = min(len(m) for m in message_lists)
    for i in range(n):
        if any(m[i] != message_lists[0][i] for m in message_lists[1:]):
            return i
    return n


def judge_prompt(message_lists: list[list[dict[str, Any]]], rubric: str, tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The judge's [system, user] messages: shared prefix once, then each trajectory's remainder once."""
    shared = _common_prefix(message_lists)
    parts = []
    if shared:
        parts.append(f"<context>\n{json.dumps(message_lists[0][:shared], ensure_ascii=False)}\n</context>")
    if tools:
        parts.append(f"<available_tools>\n{json.dumps(tools, ensure_ascii=False)}\n</available_tools>")
    for i, messages in enumerate(message_lists, start=1):
        parts.append(f'<trajectory id="{i}">\n{json.dumps(messages[shared:], ensure_ascii=False)}\n</trajectory>')
    return [{"role": "system", "content": _SYSTEM.format(rubric=rubric)}, {"role": "user", "content": "\n\n".join(parts)}]


def judge_schema(num_trajectories: int, *, max_explanation_chars: int | None = None) -> dict[str, Any]:
    """The JSON schema of the judge's answer: `{"scores": [...]}` with one entry per trajectory id
    ("1", "2", ... in order), an explanation and a score in [0, 1].

    The explanation has no `maxLength` unless `max_explanation_chars` is given: a bounded string
    makes the grammar's token masks ~100x dearer to compute (measured with llguidance at a 152k
    vocabulary: 37 ms per decode step of 256 rows on 16 cores), and the request's `max_tokens`
    bounds the answer anyway. A small judge, though, may ramble inside the explanation until
    `max_tokens` cuts the JSON short; a bound keeps its answer whole."""
    explanation: dict[str, Any] = {"type": "string"}
    if max_explanation_chars is not None:
        explanation["maxLength"] = max_explanation_chars

    def entry(i: int) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "trajectory_id": {"const": str(i)},
                "explanation": explanation,
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["trajectory_id", "explanation", "score"],
            "additionalProperties": False,
        }

    n = num_trajectories
    scores = {"type": "array", "prefixItems": [entry(i) for i in range(1, n + 1)], "items": False, "minItems": n, "maxItems": n}
    return {"type": "object", "properties": {"scores": scores}, "required": ["scores"], "additionalProperties": False}


async def serves_structured_outputs(client: Any) -> bool:
    """Whether `client`'s endpoint is a tempering server that can constrain answers to a schema.

    Asks `/v1/models` once; any failure (another API, no such route) means no.
    """
    return (await describe_endpoint(client)).has_structured_outputs


def parse_scores(text: str, num_trajectories: int) -> list[TrajectoryScore]:
    """Scores from the judge's answer (the outermost JSON object in it).

    Raises:
        ValueError: naming what is wrong: no JSON, a missing, extra or repeated id, a score outside [0, 1].
    """
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        raise ValueError("the answer holds no JSON object")
    try:
        data = json.loads(text[start:end + 1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON does not parse: {exc}") from None
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError('the JSON has no "scores" list')
    by_id: dict[str, TrajectoryScore] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise ValueError("a scores entry is not an object")
        tid = str(entry.get("trajectory_id", "")).strip()
        if tid in by_id:
            raise ValueError(f"trajectory {tid!r} is scored more than once; give each id exactly one entry")
        score = entry.get("score")
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise ValueError(f"trajectory {tid!r} has no numeric score")
        if not 0.0 <= float(score) <= 1.0:
            raise ValueError(f"trajectory {tid!r} has score {score}, outside [0, 1]")
        by_id[tid] = TrajectoryScore(tid, float(score), str(entry.get("explanation", "")))
    expected = [str(i) for i in range(1, num_trajectories + 1)]
    missing = [i for i in expected if i not in by_id]
    extra = sorted(set(by_id) - set(expected))
    if missing or extra:
        raise ValueError(f"the scores must cover trajectory ids {expected}; missing {missing}, unexpected {extra}")
    return [by_id[i] for i in expected]


async def ruler(
    message_lists: list[list[dict[str, Any]]],
    judge_model: str = DEFAULT_JUDGE,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[dict[str, Any]] | None = None,
    *,
    debug: bool = False,
    client: Any = None,
    base_url: str | None = None,
    api_key: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    structured: bool | None = None,
    max_explanation_chars: int | None = None,
) -> list[TrajectoryScore]:
    """Score conversations relative to each other (ART's `ruler`, whose positional arguments it takes).

    Args:
        message_lists: one conversation (OpenAI message dicts) per trajectory.
        judge_model: the judge: LiteLLM's provider-prefixed name ("openai/o4-mini",
            "anthropic/claude-sonnet-4-20250514", "openrouter/...", "hosted_vllm/...") unless
            `client`, `base_url` or `api_key` is given; with those, its name at that endpoint.
        extra_litellm_params: LiteLLM's parameters for each request (`api_base`, `api_key`,
            `timeout`, `temperature`, ...); they win over RULER's own. Not with `client`.
        rubric: the grading standards.
        tools: the tools the trajectories could call, shown to the judge.
        debug: print the judge's answers.
        client: an `openai.AsyncOpenAI` (e.g. `model.openai_client()` to judge with a tempering
            model); otherwise, with `base_url` or `api_key`, one made from them.
        max_tokens: the answer's budget. None: for a judge served by tempering, room for every
            explanation at its bound; 1024 for another endpoint reached by `client`; the
            provider's default through LiteLLM (as ART sends none).
        temperature: None: 0 (greedy) for a judge served by tempering or reached by `client`; the
            provider's default through LiteLLM (reasoning models such as o3 take no other).
        structured: send the answer's JSON schema as `response_format` (True), not (False), or
            when the judge is served by tempering (None, the default).
        max_explanation_chars: bound each explanation's length in that schema (see judge_schema).
            None: unbounded for an external judge, `TEMPERING_EXPLANATION_CHARS` (160) for one
            served by tempering.

    Returns:
        one TrajectoryScore per conversation, in order.

    Raises:
        RulerError: if the judge's answer is unusable twice in a row.
        RequestTimeout (a TimeoutError): the judge did not answer within the client's timeout.
        MissingDependencyError: a judge reached through LiteLLM, which is not installed (the `ruler` extra).
        ConfigError: `extra_litellm_params` together with `client`, `base_url` or `api_key`.
    """
    scores, _ = await _judge(message_lists, judge_model, extra_litellm_params, rubric, tools, debug=debug,
                             client=client, base_url=base_url, api_key=api_key, max_tokens=max_tokens,
                             temperature=temperature, structured=structured,
                             max_explanation_chars=max_explanation_chars)
    return scores


async def _judge(
    message_lists: list[list[dict[str, Any]]], judge_model: str, extra_litellm_params: dict[str, Any] | None,
    rubric: str, tools: list[dict[str, Any]] | None, *, debug: bool, client: Any, base_url: str | None,
    api_key: str | None, max_tokens: int | None, temperature: float | None, structured: bool | None,
    max_explanation_chars: int | None,
) -> tuple[list[TrajectoryScore], dict[str, float]]:
    """`ruler`'s scores, and what the judge's requests used: {"ruler_prompt_tokens": ...,
    "ruler_completion_tokens": ..., "costs/judge/ruler": USD when known}."""
    if not message_lists:
        return [], {}
    through_litellm = client is None and base_url is None and api_key is None
    if extra_litellm_params and not through_litellm:
        raise ConfigError("extra_litellm_params are LiteLLM's, for a judge_model reached through LiteLLM; with client=, "
                          "base_url= or api_key= the judge is that OpenAI-compatible endpoint: pass one or the other")
    if through_litellm:
        client = LiteLLMJudge(judge_model, extra_litellm_params)
    elif client is None:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none")
    messages = judge_prompt(message_lists, rubric, tools)
    endpoint = await describe_endpoint(client)
    if structured is None:
        structured = endpoint.has_structured_outputs
    if endpoint.is_tempering:
        client = without_retries(client)  # a judge's request that timed out would take as long again
        if max_explanation_chars is None:
            max_explanation_chars = TEMPERING_EXPLANATION_CHARS
        if max_tokens is None:
            max_tokens = answer_budget(len(message_lists), max_explanation_chars)
    request: dict[str, Any] = {"model": judge_model}
    if not through_litellm or endpoint.is_tempering:  # through LiteLLM to a provider: its defaults, as ART
        max_tokens = max_tokens or EXTERNAL_MAX_TOKENS
        temperature = 0.0 if temperature is None else temperature
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    if temperature is not None:
        request["temperature"] = temperature
    if structured:
        request["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "ruler_scores", "schema": judge_schema(len(message_lists), max_explanation_chars=max_explanation_chars),
            "strict": True}}
    base = getattr(client, "base_url", None)
    completions = []
    for attempt in range(2):
        what = (f"RULER: the judge's request {attempt + 1} of at most 2 to {judge_model!r}"
                + (f" at {base}" if base else "")
                + f" (scores for {len(message_lists)} trajectories"
                + (f", max_tokens={max_tokens})" if max_tokens is not None else ")"))
        completion = await create_completion(
            client, {**request, "messages": messages}, what=what,
            fix="pass a smaller max_tokens or max_explanation_chars, or a client with a longer timeout")
        completions.append(completion)
        text = completion.choices[0].message.content or ""
        if debug:
            print(f"[RULER] the judge's answer {attempt + 1}:\n{text}")
        try:
            return parse_scores(text, len(message_lists)), _usage(completions, client)
        except ValueError as problem:
            if attempt == 1:
                raise RulerError(f"the judge's answer could not be used twice; last problem: {problem}", completions) from None
            messages = messages + [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"That answer could not be used: {problem}. Reply again with only the JSON "
                                            f"object, with one entry for each of the {len(message_lists)} trajectory ids."},
            ]
    raise AssertionError("unreachable")


def _usage(completions: list[Any], client: Any) -> dict[str, float]:
    """The judge's tokens over `completions` and, through LiteLLM with a known price, their cost in USD."""
    usage = {"ruler_prompt_tokens": 0.0, "ruler_completion_tokens": 0.0}
    for completion in completions:
        counted = getattr(completion, "usage", None)
        usage["ruler_prompt_tokens"] += float(getattr(counted, "prompt_tokens", 0) or 0)
        usage["ruler_completion_tokens"] += float(getattr(counted, "completion_tokens", 0) or 0)
    cost_usd = getattr(client, "cost_usd", None)
    costs = [cost_usd(c) for c in completions] if cost_usd is not None else [None]
    if all(c is not None for c in costs):
        usage["costs/judge/ruler"] = sum(costs)
    return usage


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str = DEFAULT_JUDGE,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
    client: Any = None,
    base_url: str | None = None,
    api_key: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    structured: bool | None = None,
    max_explanation_chars: int | None = None,
) -> TrajectoryGroup | None:
    """A copy of `group` whose rewards are the judge's scores (for `gather_trajectory_groups(after_each=...)`);
    ART's `ruler_score_group`, whose positional arguments it takes.

    Each trajectory keeps its original reward in `metrics["independent_reward"]`, gets the score
    as `reward` and `metrics["ruler_score"]`, and the judge's explanation in `logs`. The judge is
    sent the tools of the first trajectory that has any. The group's metrics get the judge's
    tokens (`ruler_prompt_tokens`, `ruler_completion_tokens`) and, when LiteLLM knows its price,
    its cost (`costs/judge/ruler`, USD), which the step's history row reports (module docstring).
    The other arguments are `ruler`'s.

    With `swallow_exceptions`, any error of scoring (not of `additional_histories`) is logged as a
    warning instead and None is returned, so that gather drops the group, as ART does.

    Raises:
        RulerError: if the judge's answer is unusable, or the trajectories have additional_histories.
        openai.APIError: if the judge's request fails (a context overflow, an unreachable endpoint, ...);
            a timeout as RequestTimeout. Through LiteLLM, LiteLLM's errors (subclasses of openai's).
        MissingDependencyError: a judge reached through LiteLLM, which is not installed (the `ruler` extra).
    """
    trajectories = [copy.deepcopy(t) for t in group.trajectories]
    if any(t.additional_histories for t in trajectories):
        raise RulerError("RULER scores the main conversation only; these trajectories have additional_histories")
    tools = next((t.tools for t in trajectories if t.tools), None)
    try:
        scores, usage = await _judge([t.messages() for t in trajectories], judge_model, extra_litellm_params, rubric,
                                     tools, debug=debug, client=client, base_url=base_url, api_key=api_key,
                                     max_tokens=max_tokens, temperature=temperature, structured=structured,
                                     max_explanation_chars=max_explanation_chars)
    except Exception as exc:  # ART swallows any failure of the judge here, not only a bad answer
        if swallow_exceptions:
            log.warning("RULER could not score a group; it is dropped (swallow_exceptions=True): %s: %s",
                        type(exc).__name__, exc)
            return None
        raise
    for trajectory, score in zip(trajectories, scores):
        trajectory.metrics["independent_reward"] = trajectory.reward
        trajectory.metrics["ruler_score"] = score.score
        trajectory.reward = score.score
        trajectory.logs.append(f"RULER: {score.explanation}")
    return TrajectoryGroup(trajectories, exceptions=list(group.exceptions), metadata=dict(group.metadata),
                           metrics={**group.metrics, **usage}, logs=list(group.logs))
