"""ART's `_internal_config` on the real default model, and steps whose groups have no reward spread."""

from __future__ import annotations

import asyncio
import json
import logging
import warnings

import openai
import pytest

import tempering as art
from tempering.backends.art_mapping import ArtOptionWarning

PROBE = [{"role": "user", "content": "What is 5+6? Answer with just the number."}]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def registered(tmp_path_factory, loop, default_model_dir):
    """A model registered with ART options set after construction, as ART's 2048 notebook does."""
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("compat"))
    model = art.TrainableModel(name="compat", project="tests", base_model="SmolLM2-135M-Instruct")
    model._internal_config = art.dev.InternalModelConfig(
        engine_args=art.dev.EngineArgs(max_num_seqs=4, enable_prefix_caching=False, num_scheduler_steps=1),
        init_args=art.dev.InitArgs(max_seq_length=256),
        peft_args=art.dev.PeftArgs(r=4, lora_alpha=8),
        trainer_args=art.dev.TrainerArgs(max_grad_norm=0.5),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.run_until_complete(model.register(backend))
    yield model, backend, [str(w.message) for w in caught if issubclass(w.category, ArtOptionWarning)]
    loop.run_until_complete(backend.close())


async def rollout(model, prompt: str, reward: float | None) -> art.Trajectory:
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=messages, max_tokens=6, temperature=1.0)
    choice = completion.choices[0]
    lps = list(choice.sampled_logprobs)
    return art.Trajectory(messages_and_choices=[*messages, choice],
                          reward=reward if reward is not None else sum(lps) / len(lps))


async def probe(model):
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=PROBE, max_tokens=5, temperature=0)
    return list(completion.choices[0].sampled_logprobs)


def test_engine_init_and_peft_args_reach_the_served_model(registered):
    _, backend, messages = registered
    service = backend.hub.service("compat")
    assert (service.engine.config.max_num_seqs, service.engine.config.enable_prefix_caching) == (4, False)
    assert service.max_seq_len == 256
    assert (service.lora.rank, service.lora.alpha) == (4, 8)
    assert len(messages) == 1 and "engine_args.num_scheduler_steps" in messages[0]


def test_max_seq_length_is_enforced_by_the_server(registered, loop):
    model, _, _ = registered
    long_prompt = [{"role": "user", "content": "count: " + " ".join(str(i) for i in range(400))}]
    with pytest.raises(openai.BadRequestError):
        loop.run_until_complete(model.openai_client().chat.completions.create(
            model=model.name, messages=long_prompt, max_tokens=4))


def test_a_step_without_reward_spread_says_so_once_and_leaves_the_policy_unchanged(registered, loop, caplog):
    model, _, _ = registered

    async def step():
        before = await probe(model)
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, p, reward=-1.0) for _ in range(2)) for p in ("Say hi.", "Name a fruit.")),
            pbar_desc=None)
        with caplog.at_level(logging.WARNING, logger="tempering"):
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        return before, result, await probe(model)

    before, result, after = loop.run_until_complete(step())
    assert result.step == 1 and result.is_adapter_unchanged
    assert (result.num_groups, result.num_groups_trainable) == (2, 0)
    said = [r for r in caplog.records if "reward spread" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(said) == 1 and "none of the 2 groups" in said[0].getMessage()
    assert after == before


def test_a_step_with_reward_spread_trains_the_peft_args_adapter(registered, loop, caplog):
    model, backend, _ = registered

    async def step():
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, p, reward=None) for _ in range(3)) for p in ("Say hi.", "Name a fruit.")),
            pbar_desc=None)
        return await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))

    with caplog.at_level(logging.WARNING, logger="tempering"):
        result = loop.run_until_complete(step())
    assert not result.is_adapter_unchanged and result.num_groups_trainable == 2
    assert not [r for r in caplog.records if "reward spread" in r.getMessage() and r.levelno >= logging.WARNING]
    adapter = json.loads((backend.path / "tests/models/compat/checkpoints/0002/adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)
