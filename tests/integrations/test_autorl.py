"""AutoRL with the real default model as generator, judge and policy: a task description in, one step out."""

from __future__ import annotations

import asyncio
import json

import pytest

import tempering as art
from tempering import autorl
from tempering.errors import ConfigError

TASK = "Answer a question about animals in one short sentence."


def test_autorl_generates_disjoint_inputs_and_trains_one_step_with_ruler_rewards(tmp_path, default_model_dir):
    async def main():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="auto", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            with pytest.raises(ConfigError, match="both judge_model and judge_client"):
                await autorl.train(model, TASK, judge_model="gpt-4.1")
            dataset = await autorl.generate_dataset(TASK, num_train_inputs=1, num_val_inputs=1, generator_model=model.name,
                                                    generator_client=model.openai_client(), max_input_chars=60,
                                                    max_tokens=100)
            steps = []
            result = await autorl.train(
                model, dataset, groups_per_step=1, rollouts_per_group=2, max_tokens=12, learning_rate=1e-3,
                judge_options={"max_tokens": 120, "max_explanation_chars": 30, "temperature": 1.0},
                on_step=lambda step, metrics: steps.append(step))
            return dataset, result, steps, await model.get_step()

    dataset, result, steps, step = asyncio.run(main())
    assert len(dataset.train_inputs) == 1 and len(dataset.val_inputs) == 1
    assert all(0 < len(x) <= 60 for x in dataset.train_inputs + dataset.val_inputs)
    assert not set(dataset.train_inputs) & set(dataset.val_inputs)
    assert TASK in dataset.system_prompt
    assert step == 1 and steps == [1] and result.num_steps_skipped == 0
    [metrics] = result.step_metrics
    assert 0.0 <= metrics["train/ruler_score"] <= 1.0 and metrics["train/reward"] == metrics["train/ruler_score"]
    for val in (result.val_before, result.val_after):
        assert val["val/num_trajectories"] == 2 and 0.0 <= val["val/ruler_score"] <= 1.0
    history = [json.loads(line) for line in (tmp_path / "tests/models/auto/history.jsonl").read_text().splitlines()]
    assert [("train/reward" in row, "val/reward" in row) for row in history] == [(False, True), (True, False), (False, True)]
