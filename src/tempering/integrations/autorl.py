"""AutoRL: train a model on a task described in one sentence, with no data from the user.

After ART's AutoRL notebook (which has no library code in ART): a model writes the task's inputs,
the policy answers each input several times, RULER compares the answers of each group, and
the scores train the policy.

    result = await tempering.autorl.train(model, "Summarize a product review in one sentence.",
                                          num_train_inputs=16, num_val_inputs=8, num_epochs=2)

By default the model being trained also writes the inputs and judges (so it runs anywhere,
the default model on a CPU included); pass `generator_client=` / `judge_client=` (any
OpenAI-compatible client) and their model names to use stronger models. Inputs are requested
as JSON through the answer's schema (`response_format`, integrations/generation.py), which a
tempering server enforces with structured outputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..gather import gather_trajectory_groups
from ..rewards.ruler import DEFAULT_RUBRIC, ruler_score_group
from ..types import TrainConfig, Trajectory, TrajectoryGroup
from ..utils.iterate_dataset import iterate_dataset
from .generation import GenerationError, generate_items, make_client, resolve_budget

__all__ = ["TEMPERING_INPUT_CHARS", "AutoRLDataset", "AutoRLResult", "GenerationError", "default_system_prompt",
           "generate_dataset", "generate_inputs", "rollout", "train"]

log = logging.getLogger("tempering")

TEMPERING_INPUT_CHARS = 300
"""Each generated input's length bound when a tempering server writes them and `max_input_chars`
is not given (`train`'s own default): a user message of a few sentences, which keeps a small
generator on a CPU from writing inside one string until `max_tokens` runs out."""

_PROMPT = """\
An AI assistant is being trained for this task:

{task}

Write {n} different, realistic inputs that a user could send to the assistant for this task. Each \
input is the user's whole message, self-contained, and different from the others.

Answer with a JSON object {{"inputs": ["...", "..."]}} with exactly {n} inputs."""


def default_system_prompt(task_description: str) -> str:
    """The policy's system prompt when none is given: the task, stated to the assistant."""
    return f"You are an assistant for this task: {task_description.strip()}\nRespond to the user's input."


@dataclass
class AutoRLDataset:
    """What AutoRL trains and validates on: the task, the policy's system prompt and the generated inputs."""

    task_description: str
    system_prompt: str
    train_inputs: list[str]
    val_inputs: list[str]


@dataclass
class AutoRLResult:
    """What `train` did: the dataset, the validation metrics before and after, and each step's metrics."""

    dataset: AutoRLDataset
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    num_steps_skipped: int = 0


async def generate_inputs(
    task_description: str,
    num_inputs: int = 16,
    *,
    generator_model: str = "openai/gpt-4.1-mini",
    generator_client: Any = None,
    generator_api_key: str | None = None,
    generator_base_url: str = "https://openrouter.ai/api/v1",
    max_input_chars: int | None = None,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    structured: bool | None = None,
    max_attempts: int = 3,
    exclude: set[str] | None = None,
) -> list[str]:
    """Have a model write `num_inputs` distinct user inputs for the task.

    Args:
        generator_model, generator_client, generator_api_key, generator_base_url: the endpoint, as
            in `tempering.mcp.generate_scenarios` (default OpenRouter with `OPENROUTER_API_KEY`;
            `generator_client=model.openai_client()` to use a tempering model).
        max_input_chars: bound each input's length in the schema. None: unbounded for an external
            API, `TEMPERING_INPUT_CHARS` (300) for a tempering server.
        max_tokens: the answer's token budget per request. None: 8000 for an external API; for a
            tempering server, room for `num_inputs` inputs of `max_input_chars`.
        structured: send the JSON schema as `response_format` (True), never (False), or unless the
            endpoint is a tempering server without structured outputs (None).
        exclude: inputs not to repeat (compared after stripping whitespace).

    Returns:
        `num_inputs` inputs, stripped, without duplicates.

    Raises:
        ConfigError (a ValueError): an empty task description, or no client and no API key.
        GenerationError (a ValueError): if `max_attempts` answers held too few valid, new inputs.
        RequestTimeout (a TimeoutError): a request got no answer within the client's timeout.
    """
    if not task_description.strip():
        raise ConfigError("describe the task: task_description is empty")
    client = make_client(generator_client, generator_base_url, generator_api_key or os.environ.get("OPENROUTER_API_KEY"),
                         who="autorl.generate_inputs")
    seen = {x.strip() for x in exclude or ()}

    def check(raw: Any) -> str:
        if not isinstance(raw, str) or not raw.strip():
            raise ValueError("an input must be a non-empty string")
        text = raw.strip()
        if text in seen:
            raise ValueError("a repeated input")
        seen.add(text)
        return text

    budget = await resolve_budget(client, num_items=num_inputs, max_tokens=max_tokens, max_item_chars=max_input_chars,
                                  structured=structured, tempering_item_chars=TEMPERING_INPUT_CHARS)
    item: dict[str, Any] = {"type": "string", "minLength": 1}
    if budget.max_item_chars is not None:
        item["maxLength"] = budget.max_item_chars
    return await generate_items(
        client=budget.client, model=generator_model,
        prompt=lambda n: _PROMPT.format(task=task_description.strip(), n=n),
        key="inputs", item_schema=item, num_items=num_inputs, check_item=check, max_tokens=budget.max_tokens,
        temperature=temperature, structured=budget.structured, max_attempts=max_attempts, schema_name="task_inputs",
        who="autorl.generate_inputs", fix="pass a smaller max_tokens or max_input_chars (each input's length), or "
                                          "fewer inputs; or a generator_client with a longer timeout")


async def generate_dataset(
    task_description: str,
    *,
    num_train_inputs: int = 16,
    num_val_inputs: int = 8,
    system_prompt: str | None = None,
    generator_model: str = "openai/gpt-4.1-mini",
    generator_client: Any = None,
    generator_api_key: str | None = None,
    generator_base_url: str = "https://openrouter.ai/api/v1",
    max_input_chars: int | None = None,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    structured: bool | None = None,
    max_attempts: int = 3,
) -> AutoRLDataset:
    """Training and validation inputs for the task, written by a model (the other arguments are
    `generate_inputs`' own).

    The validation inputs are generated apart from, and never equal to, the training inputs.

    Raises:
        ConfigError, GenerationError, RequestTimeout: as `generate_inputs`.
    """
    generator = {"generator_model": generator_model, "generator_client": generator_client,
                 "generator_api_key": generator_api_key, "generator_base_url": generator_base_url,
                 "max_input_chars": max_input_chars, "max_tokens": max_tokens, "temperature": temperature,
                 "structured": structured, "max_attempts": max_attempts}
    train_inputs = await generate_inputs(task_description, num_train_inputs, **generator)
    val_inputs = (await generate_inputs(task_description, num_val_inputs, exclude=set(train_inputs), **generator)
                  if num_val_inputs > 0 else [])
    return AutoRLDataset(task_description, system_prompt or default_system_prompt(task_description),
                         train_inputs, val_inputs)


async def rollout(model: Any, system_prompt: str, user_input: str, *, max_tokens: int = 256,
                  temperature: float = 1.0) -> Trajectory:
    """One answer of `model` to `user_input` under `system_prompt`; reward 0, for RULER to set."""
    traj = Trajectory(messages_and_choices=[{"role": "system", "content": system_prompt},
                                            {"role": "user", "content": user_input}],
                      metadata={"input": user_input[:500]})
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=traj.messages(), max_tokens=max_tokens, temperature=temperature)
    traj.messages_and_choices.append(completion.choices[0])
    return traj.finish()


async def train(
    model: Any,
    task: str | AutoRLDataset,
    *,
    num_train_inputs: int = 16,
    num_val_inputs: int = 8,
    num_epochs: int = 1,
    groups_per_step: int = 2,
    rollouts_per_group: int = 4,
    learning_rate: float = 1e-5,
    max_tokens: int = 256,
    temperature: float = 1.0,
    system_prompt: str | None = None,
    generator_model: str | None = None,
    generator_client: Any = None,
    max_input_chars: int | None = 300,
    judge_model: str | None = None,
    judge_client: Any = None,
    rubric: str = DEFAULT_RUBRIC,
    judge_options: dict[str, Any] | None = None,
    validate: bool = True,
    max_exceptions: float = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> AutoRLResult:
    """Generate the data, then train `model` on it with RULER rewards, validating before and after.

    Args:
        model: a registered TrainableModel.
        task: the task in plain language, or an AutoRLDataset made earlier (nothing is generated).
        num_train_inputs, num_val_inputs: inputs to generate (one group of rollouts each).
        num_epochs, groups_per_step: passes over the training inputs, and inputs per step
            (resumes from `await model.get_step()`).
        rollouts_per_group: answers per input, compared by RULER (4 to 8 is usual).
        generator_model, generator_client: who writes the inputs: a model name and an
            OpenAI-compatible client, both or neither (default: the model being trained).
        max_input_chars: bound on each generated input's length.
        judge_model, judge_client: RULER's judge, both or neither (default: the model being
            trained); a judge served by tempering answers through the scores' JSON schema.
        judge_options: more options of `ruler` (max_tokens, temperature, max_explanation_chars, ...).
        validate: log `val/...` metrics (RULER rewards of the validation groups) before and after.
        max_exceptions: failed rollouts tolerated per gather (see gather_trajectory_groups).
        on_step: called with (step, metrics) after each training step.

    Returns:
        AutoRLResult. A step whose groups the judge could not score (they are dropped, as with
        `ruler_score_group(swallow_exceptions=True)`) is skipped and counted in num_steps_skipped.

    Raises:
        ConfigError: a generator or judge given by only one of its name and client; see also
            generate_dataset.
        GenerationError: as generate_dataset.
    """
    generator_name, generator = _endpoint(model, generator_model, generator_client, "generator")
    judge_name, judge = _endpoint(model, judge_model, judge_client, "judge")
    if isinstance(task, AutoRLDataset):
        dataset = task
    else:
        dataset = await generate_dataset(
            task, num_train_inputs=num_train_inputs, num_val_inputs=num_val_inputs, system_prompt=system_prompt,
            generator_model=generator_name, generator_client=generator, max_input_chars=max_input_chars)

    async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
        return await ruler_score_group(group, judge_name, client=judge, rubric=rubric, swallow_exceptions=True,
                                       **(judge_options or {}))

    async def gather(inputs: list[str], desc: str) -> list[TrajectoryGroup]:
        return await gather_trajectory_groups(
            (TrajectoryGroup(rollout(model, dataset.system_prompt, x, max_tokens=max_tokens, temperature=temperature)
                             for _ in range(rollouts_per_group)) for x in inputs),
            pbar_desc=desc, after_each=score, max_exceptions=max_exceptions)

    result = AutoRLResult(dataset)
    if validate and dataset.val_inputs:
        result.val_before = await model.log(await gather(dataset.val_inputs, "val"), split="val")
    for batch in iterate_dataset(dataset.train_inputs, groups_per_step=groups_per_step, num_epochs=num_epochs,
                                 initial_step=await model.get_step(), use_tqdm=False):
        groups = [g for g in await gather(batch.items, f"train step {batch.step + 1}") if len(g)]
        if not groups:
            log.warning("autorl: the judge scored no group of step %d; the step is skipped", batch.step + 1)
            result.num_steps_skipped += 1
            continue
        trained = await model.train(groups, config=TrainConfig(learning_rate=learning_rate))
        result.step_metrics.append(dict(trained.metrics))
        if on_step is not None:
            on_step(trained.step, dict(trained.metrics))
    if validate and dataset.val_inputs:
        result.val_after = await model.log(await gather(dataset.val_inputs, "val"), split="val")
    return result


def _endpoint(model: Any, name: str | None, client: Any, role: str) -> tuple[str, Any]:
    """(model name, client) of the generator or judge: the model being trained unless both are given."""
    if name is None and client is None:
        return model.get_inference_name(), model.openai_client()
    if name is None or client is None:
        raise ConfigError(f"give both {role}_model and {role}_client (an OpenAI-compatible client), or neither "
                          "to use the model being trained")
    return name, client
