"""The staleness rules of the pipeline: group versions, the admission bound, what gets dropped."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from openai.types.chat.chat_completion import Choice

import tempering as art
from tempering.pipeline_trainer.staleness import group_staleness, max_groups_ahead, stamp_versions


def choice(versions):
    return Choice.model_validate({
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"},
        "logprobs": {"content": [{"token": "x", "logprob": -1.0, "bytes": [], "top_logprobs": []} for _ in versions]},
        "token_ids": [7] * len(versions), "prompt_token_ids": [1], "policy_versions": versions,
    })


def test_versions_come_from_the_tokens_and_fall_back_to_the_pipeline_versions():
    spanning = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice([2, 2, 3])])
    unstamped = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])
    preset = art.Trajectory(messages_and_choices=[choice([5])], initial_policy_version=1, final_policy_version=1)
    group = art.TrajectoryGroup([spanning, unstamped, preset])
    stamp_versions(group, started=4, finished=6)
    assert (spanning.initial_policy_version, spanning.final_policy_version) == (2, 3)
    assert (unstamped.initial_policy_version, unstamped.final_policy_version) == (4, 6)
    assert (preset.initial_policy_version, preset.final_policy_version) == (1, 1)  # set by the user: kept
    assert group_staleness(group, 5) == 4  # the oldest token decides


def test_the_bound_keeps_every_planned_group_within_max_staleness():
    # on-policy: nothing runs during a step, one batch at a time otherwise
    assert max_groups_ahead(groups_per_step=4, max_staleness=0, is_training=True) == 0
    assert max_groups_ahead(groups_per_step=4, max_staleness=0, is_training=False) == 4
    # one step off-policy: the next batch runs while the current one trains
    assert max_groups_ahead(groups_per_step=4, max_staleness=1, is_training=True) == 4
    assert max_groups_ahead(groups_per_step=4, max_staleness=1, is_training=False) == 8
    # simulate in-order batches: a group admitted with `ahead` groups before it is trained
    # ahead // G + 1 batches later, each batch one version on; its staleness never exceeds the bound
    for staleness in range(4):
        for is_training in (False, True):
            bound = max_groups_ahead(groups_per_step=3, max_staleness=staleness, is_training=is_training)
            for ahead in range(bound):
                batches_later = ahead // 3 + 1
                assert batches_later - (0 if is_training else 1) <= staleness
            assert (bound // 3 + 1) - (0 if is_training else 1) > staleness  # one more would be too stale


def test_the_pipeline_trains_with_the_decoupled_objective_unless_told_otherwise():
    model = art.TrainableModel(name="m", project="p", base_model="SmolLM2-135M-Instruct")

    async def rollout(model, scenario, config):
        raise AssertionError("not run")

    default = art.PipelineTrainer(model, None, rollout, [], group_size=2, learning_rate=1e-4)
    assert default.train_config.decoupled and default.train_config.learning_rate == 1e-4
    explicit = art.PipelineTrainer(model, None, rollout, [], group_size=2,
                                   train_config=art.TrainConfig(decoupled=False, loss_fn="cispo"))
    assert not explicit.train_config.decoupled and explicit.train_config.loss_fn == "cispo"


class _CountingModel:
    """Just what PipelineTrainer calls on a model: its step, a training call that advances it, a log."""

    _backend = None

    def __init__(self) -> None:
        self.step = 0
        self.calls = 0  # training calls begun
        self.trained: list[list] = []

    async def get_step(self) -> int:
        return self.step

    async def train(self, groups, config=None):
        self.calls += 1
        await asyncio.sleep(0.02)
        self.trained.append([g.trajectories[0].metadata["scenario"] for g in groups])
        self.step += 1
        return SimpleNamespace(step=self.step, metrics={})

    async def log(self, *args, **kwargs):
        await asyncio.sleep(0.01)  # writes a file: the rollout workers run meanwhile
        return {}


def test_a_dropped_stale_group_lets_the_workers_start_its_replacement():
    # scenario 0's rollout, started at step 0, finishes while step 2 trains: the trainer drops it
    # (2 steps stale) when it takes the last batch. The slot it held must go back to the workers, or
    # that batch waits forever for a group nobody starts.
    model = _CountingModel()

    async def rollout(model, scenario, config):
        while scenario == 0 and model.calls < 2:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.001)
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=0.0,
                              metadata={"scenario": scenario})

    pipeline = art.PipelineTrainer(model, None, rollout, range(8), group_size=1, groups_per_step=2,
                                   max_staleness=1, max_steps=3, pbar=False)
    result = asyncio.run(asyncio.wait_for(pipeline.train(), 10))
    assert result.num_steps == 3 and result.num_stale_groups_dropped == 1
    assert 0 not in sum(model.trained, []) and all(len(batch) == 2 for batch in model.trained)
