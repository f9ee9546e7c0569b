import asyncio
import json

import pytest
from openai.types.chat.chat_completion import Choice

import tempering as art


def _choice(content="4"):
    return Choice.model_validate({
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content},
        "logprobs": {"content": [{"token": "4", "logprob": -0.1, "bytes": [52], "top_logprobs": []}]},
        "token_ids": [19], "prompt_token_ids": [1, 2],
    })


def test_trajectory_round_trips_through_json_with_its_choice_and_token_ids():
    t = art.Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}, _choice()], reward=1.0)
    back = art.Trajectory.model_validate_json(t.model_dump_json())
    assert isinstance(back.messages_and_choices[1], Choice)
    assert back.messages_and_choices[1].token_ids == [19]
    assert back.messages() == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    json.dumps(t.for_logging())


def test_group_built_from_coroutines_is_pending_until_awaited():
    async def rollout(r):
        await asyncio.sleep(0)
        return art.Trajectory(messages_and_choices=[], reward=r)

    async def main():
        group = art.TrajectoryGroup(rollout(r) for r in (0.0, 1.0))
        assert group.is_pending and len(group) == 0
        await group
        return group

    group = asyncio.run(main())
    assert sorted(group.rewards()) == [0.0, 1.0]


def test_gather_keeps_exceptions_within_budget_and_raises_past_it():
    async def rollout(fail):
        if fail:
            raise RuntimeError("tool crashed")
        return art.Trajectory(messages_and_choices=[], reward=1.0)

    async def run(max_exceptions):
        return await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(f) for f in flags) for flags in [(False, True), (False, False)]),
            pbar_desc=None, max_exceptions=max_exceptions)

    groups = asyncio.run(run(1))
    assert [len(g) for g in groups] == [1, 2]
    assert groups[0].exceptions[0].type == "RuntimeError"
    with pytest.raises(RuntimeError, match="tool crashed"):
        asyncio.run(run(0))


def test_after_each_can_rescore_or_drop_groups():
    async def rollout(r):
        return art.Trajectory(messages_and_choices=[], reward=r)

    async def after_each(group):
        if group.trajectories[0].reward == 0.0:
            return None
        for t in group:
            t.reward *= 10
        return group

    async def main():
        return await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(r) for _ in range(2)) for r in (0.0, 1.0)), pbar_desc=None, after_each=after_each)

    groups = asyncio.run(main())
    assert [g.rewards() for g in groups] == [[10.0, 10.0]]


def test_gather_trajectories_returns_flat_results_in_order():
    async def rollout(r):
        return art.Trajectory(messages_and_choices=[], reward=r)

    out = asyncio.run(art.gather_trajectories([rollout(1.0), rollout(2.0)], pbar_desc=None))
    assert [t.reward for t in out] == [1.0, 2.0]


def test_train_config_defaults_and_validation():
    c = art.TrainConfig()
    assert (c.clip_low, c.clip_high, c.aggregation, c.advantage_mode) == (0.2, 0.2, "token_mean", "group")
    cispo = art.TrainConfig(loss_fn="cispo")
    assert (cispo.clip_low, cispo.clip_high) == (1.0, 4.0)
    gspo = art.TrainConfig(loss_fn="gspo")
    assert (gspo.clip_low, gspo.clip_high, gspo.aggregation) == (3e-4, 4e-4, "sequence_mean")
    assert art.TrainConfig(beta=0.1).kl_penalty_coef == 0.1  # ART <= 0.4's name
    assert art.TrainConfig(normalize_advantages=False).advantage_mode == "none"
    with pytest.raises(ValueError):
        art.TrainConfig(learning_rate=-1)
    with pytest.raises(ValueError, match="importance_ratio_mask"):
        art.TrainConfig(importance_ratio_mask=(1.5, 2.0))


@pytest.mark.parametrize("make", [
    lambda: art.TrainConfig(learning_rate=float("inf")),
    lambda: art.TrainConfig(weight_decay=float("inf")),
    lambda: art.TrainConfig(kl_penalty_coef=float("nan")),
    lambda: art.TrainSFTConfig(learning_rate=float("nan")),
    lambda: art.TrainSFTConfig(learning_rate=[1e-4, float("inf")]),
    lambda: art.types.LoRAConfig(alpha=float("inf")),
], ids=["lr-inf", "weight-decay-inf", "kl-nan", "sft-lr-nan", "sft-lr-list-inf", "lora-alpha-inf"])
def test_values_that_would_make_the_adapter_non_finite_are_refused(make):
    """An infinite learning rate wrote NaN into the live adapter and its checkpoint."""
    with pytest.raises((ValueError, art.ConfigError)):
        make()
    assert art.TrainConfig(epsilon_high=float("inf")).epsilon_high == float("inf")  # "no upper clip" stays valid
