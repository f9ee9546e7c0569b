"""PipelineTrainer on LocalBackend with the real default model: it trains while rollouts run, keeps
every trained token within max_staleness, validates saved steps in the background, and logs it all."""

from __future__ import annotations

import asyncio
import math

import pytest

import tempering as art
from tempering.engine import EngineConfig
from tempering.errors import ConfigError

PROMPTS = [f"What is {a}+{b}? Answer with just the number." for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]]


async def rollout(model, prompt, config, *, step=None):
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step), messages=traj.messages(), max_tokens=8, temperature=1.0)
    traj.messages_and_choices.append(completion.choices[0])
    lps = list(completion.choices[0].sampled_logprobs)
    traj.reward = math.exp(sum(lps) / len(lps))  # differs between samples: every group has spread
    return traj


async def validate(model, step, config):
    group = art.TrajectoryGroup([await rollout(model, p, config, step=step) for p in PROMPTS[:2]])
    for t in group:  # `name@step` is that step's checkpoint, frozen while training goes on
        assert set(t.policy_versions()) == {step}, "a failed check drops this step's validation"
    return [group]


def test_the_pipeline_trains_while_rollouts_run_within_the_staleness_bound(tmp_path):
    async def run():
        async with art.LocalBackend(path=tmp_path, engine_config=EngineConfig(cpu_kv_cache_bytes=256 << 20)) as backend:
            model = art.TrainableModel(name="pipe", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            with pytest.raises(ConfigError, match="same option"):
                art.PipelineTrainer(model, backend, rollout, PROMPTS, groups_per_step=2, min_batch_size=3)
            trainer = art.PipelineTrainer(
                model, backend, rollout, PROMPTS * 10, eval_fn=validate, group_size=2, groups_per_step=2,
                max_staleness=1, max_steps=3, eval_every_n_steps=2, learning_rate=1e-3, pbar=False,
            )
            result = await trainer.train()
            return result, await model.get_step(), await backend._read_history(model)

    result, step, history = asyncio.run(run())
    assert step == result.step == 3 and result.num_steps == 3
    assert result.num_groups_trained == 6 and result.num_trajectories_trained == 12
    train_rows = [r for r in history if "train/reward" in r]
    assert [r["step"] for r in train_rows] == [0, 1, 2]
    assert all(r["offpolicy/policy_age_max"] <= 1 for r in train_rows)  # never staler than the bound
    # the second batch ran while the first step trained: its tokens are one version old
    assert train_rows[1]["offpolicy/policy_age_max"] == 1
    pipeline_rows = [r for r in history if "pipeline/num_stale_groups_dropped" in r]
    assert [r["step"] for r in pipeline_rows] == [0, 1, 2]
    assert pipeline_rows[-1]["pipeline/num_stale_groups_dropped"] == result.num_stale_groups_dropped
    # validation of the start, every 2 steps and the last, each against that step's checkpoint
    assert sorted(result.val_rewards) == [0, 2, 3]
    assert sorted(r["step"] for r in history if "val/reward" in r) == [0, 2, 3]
