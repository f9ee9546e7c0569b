"""Fixtures of the service tests: a run of the default model trained one RL step, and its exports."""

from __future__ import annotations

import asyncio

import pytest

ADDITION = "What is 12+13? Answer with just the number."


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, default_model_dir):
    """The run directory of the default model trained one RL step (checkpoint 1, on 4 sampled answers
    of 6 tokens, rewarded 0..3 for a spread), with `val/reward` logged at step 1."""
    import tempering as art

    root = tmp_path_factory.mktemp("trained")

    async def main():
        async with art.LocalBackend(path=root) as backend:
            model = art.TrainableModel(name="run", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            client = model.openai_client()

            async def rollout(i):
                t = art.Trajectory(messages_and_choices=[{"role": "user", "content": ADDITION}])
                c = await client.chat.completions.create(model=model.name, messages=t.messages(), max_tokens=6,
                                                         temperature=1.0, seed=i)
                t.messages_and_choices.append(c.choices[0])
                t.reward = float(i)
                return t

            groups = await art.gather_trajectory_groups([art.TrajectoryGroup(rollout(i) for i in range(4))],
                                                        pbar_desc=None)
            await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
            val = await art.gather_trajectory_groups([art.TrajectoryGroup(rollout(i) for i in range(2))],
                                                     pbar_desc=None)
            await model.log(val, split="val")

    asyncio.run(main())
    return root / "tests" / "models" / "run"


@pytest.fixture(scope="session")
def exported_adapter(trained_run, tmp_path_factory):
    """`trained_run`'s latest checkpoint exported as a standalone adapter."""
    from tempering.service.export import export_model

    out = tmp_path_factory.mktemp("exports") / "adapter"
    export_model(trained_run, out=out)
    return out
