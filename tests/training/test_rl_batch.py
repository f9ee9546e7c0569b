"""rl_batch: from scored trajectory groups to the trainer's sequences, without a model."""

import math

import pytest
from test_tokenize import FakeRenderer, choice

from tempering.errors import TrajectoryError
from tempering.training.rl_batch import rl_batch
from tempering.types import TrainConfig, Trajectory, TrajectoryGroup


def trajectory(reward, token_ids=(7, 2), *, answered=True):
    items = [{"role": "user", "content": "q"}]
    if answered:
        items.append(choice(list(token_ids), [-0.5] * len(token_ids), prompt_token_ids=[1, 5]))
    return Trajectory(messages_and_choices=items, reward=reward)


def batch(groups, **config):
    return rl_batch(groups, TrainConfig(**config), renderer=FakeRenderer(), max_seq_len=100, vocab_size=50,
                    policy_version=0)


def test_groups_become_sequences_with_their_advantages_and_a_group_without_spread_adds_none():
    out = batch([TrajectoryGroup([trajectory(1.0), trajectory(0.0)]), TrajectoryGroup([trajectory(0.5), trajectory(0.5)])])
    assert (out.num_groups, out.num_trainable, out.num_without_tokens) == (2, 1, 0)
    assert [s.advantage for s in out.sequences] == pytest.approx([1.0, -1.0], abs=1e-5)  # (r - mean) / std
    assert [(s.group_index, s.trajectory_index) for s in out.sequences] == [(0, 0), (0, 1)]
    assert [s.advantage for s in batch([TrajectoryGroup([trajectory(1.0), trajectory(0.0)])],
                                       normalize_advantages=False).sequences] == [0.5, -0.5]


def test_a_trajectory_without_an_assistant_turn_counts_in_its_groups_mean_and_adds_no_tokens():
    out = batch([TrajectoryGroup([trajectory(1.0), trajectory(0.0), trajectory(0.0, answered=False)])])
    assert out.num_without_tokens == 1 and len(out.sequences) == 2
    mean, std = 1 / 3, math.sqrt(2 / 9)
    assert out.sequences[0].advantage == pytest.approx((1 - mean) / (std + 1e-6))


def test_bad_batches_are_refused_naming_the_group_and_trajectory():
    with pytest.raises(TrajectoryError, match="empty list of trajectory groups"):
        batch([])
    with pytest.raises(TrajectoryError, match="group 0, trajectory 1 has reward nan"):
        batch([TrajectoryGroup([trajectory(1.0), trajectory(math.nan)])])
    with pytest.raises(TrajectoryError, match="none of the 2 trajectories has an assistant turn"):
        batch([TrajectoryGroup([trajectory(1.0, answered=False), trajectory(0.0, answered=False)])])
    # a Choice sampled from a model with a larger vocabulary would index past the embedding
    with pytest.raises(TrajectoryError, match=r"group 0, trajectory 1: token id 77 is outside the model's vocabulary \[0, 50\)"):
        batch([TrajectoryGroup([trajectory(1.0), trajectory(0.0, token_ids=(7, 77, 2))])])
