"""From scored trajectory groups to the trainer's sequences: check, tokenize, assign advantages.

`rl_batch` is the trajectory handling of an RL step before any tensor exists: every reward
checked finite, every trajectory tokenized from its sampled Choices (tokenize.py), every token id
checked against the vocabulary, and each group's advantages (advantages.py) set on its
trajectories' sequences. A group whose rewards are all equal teaches nothing and adds no sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import TrajectoryError
from ..types import TrainConfig, TrajectoryGroup, check_reward, out_of_vocabulary
from .advantages import group_advantages
from .tokenize import TokenizedSequence, tokenize_trajectory

__all__ = ["RLBatch", "in_vocabulary", "rl_batch"]


@dataclass(slots=True)
class RLBatch:
    """An RL step's input: the trained sequences and what the step's metrics count."""

    sequences: list[TokenizedSequence]  # each with its advantage, group/trajectory index and on_policy set
    num_trainable: int  # groups with a trajectory that has tokens and a nonzero advantage
    num_groups: int
    num_without_tokens: int  # trajectories with no assistant turn (they count in their group's advantages)


def rl_batch(groups: list[TrajectoryGroup], config: TrainConfig, *, renderer: Any, max_seq_len: int,
             vocab_size: int, policy_version: int) -> RLBatch:
    """Validate and tokenize `groups`; set each trained sequence's advantage.

    Advantages follow `config.advantage_mode`: "group" (r - mean) / (std + eps) per group (GRPO),
    "batch" the group's mean with the whole batch's std (Lite PPO; TRL's scale_rewards="batch"),
    otherwise r - mean. A sequence is `on_policy` when every token of its trajectory was sampled
    at `policy_version` (the live policy's).

    Raises:
        TrajectoryError: for an empty list of groups, groups that are all empty, a non-finite
            reward, a token id outside [0, vocab_size), or a batch in which no trajectory has an
            assistant turn; the message names the group and trajectory.
    """
    if not groups:
        raise TrajectoryError("train() got an empty list of trajectory groups; gather some rollouts first")
    if not any(len(g) for g in groups):
        raise TrajectoryError("every trajectory group is empty (all rollouts failed?); see each group's `exceptions`")
    rewards_G = [
        [check_reward(t.reward, where=f"group {g}, trajectory {i}") for i, t in enumerate(group)]
        for g, group in enumerate(groups)
    ]
    mode = config.advantage_mode
    batch_std = None
    if mode == "batch":  # group mean, std over the whole batch (Lite PPO; TRL scale_rewards="batch")
        flat = [r for rewards in rewards_G for r in rewards]
        mean = sum(flat) / len(flat)
        batch_std = math.sqrt(sum((r - mean) ** 2 for r in flat) / len(flat))
    sequences_G = []  # per group, per trajectory: its sequences ([] for one with no assistant turn)
    for g, group in enumerate(groups):
        per_trajectory = []
        for i, trajectory in enumerate(group):
            try:
                per_trajectory.append(in_vocabulary(tokenize_trajectory(
                    trajectory, renderer, max_seq_len=max_seq_len, exclude_forced_tokens=config.exclude_forced_tokens,
                    routing_replay=config.moe_routing_replay), vocab_size))
            except TrajectoryError as exc:
                raise TrajectoryError(f"group {g}, trajectory {i}: {exc}") from None
        sequences_G.append(per_trajectory)
    num_without_tokens = sum(not seqs for per_trajectory in sequences_G for seqs in per_trajectory)
    if num_without_tokens == sum(len(g) for g in groups):
        raise TrajectoryError(
            f"none of the {num_without_tokens} trajectories has an assistant turn, so there is nothing to train "
            "on; append each completion's Choice (completion.choices[0]) to its trajectory's messages_and_choices"
        )
    sequences, num_trainable = [], 0
    for g, per_trajectory in enumerate(sequences_G):
        # every trajectory's reward counts, one with no tokens included: it shifts the group's mean
        advantages = group_advantages(rewards_G[g], normalize=mode == "group")
        if batch_std is not None:
            advantages = [a / (batch_std + 1e-6) for a in advantages]
        # a sequence with no token in the loss (every sampled token forced by a grammar, with
        # exclude_forced_tokens) teaches nothing: a group of only those is not trainable
        per_trajectory = [[s for s in seqs if any(s.loss_mask)] for seqs in per_trajectory]
        trained = [(i, a, seqs) for i, (a, seqs) in enumerate(zip(advantages, per_trajectory)) if a != 0.0 and seqs]
        num_trainable += bool(trained)
        for i, advantage, seqs in trained:
            versions = groups[g].trajectories[i].policy_versions()
            on_policy = bool(versions) and all(v == policy_version for v in versions)
            for seq in seqs:
                seq.advantage, seq.group_index, seq.trajectory_index = advantage, g, i
                seq.on_policy = on_policy
                sequences.append(seq)
    return RLBatch(sequences, num_trainable, len(groups), num_without_tokens)


def in_vocabulary(sequences: list[TokenizedSequence], vocab_size: int) -> list[TokenizedSequence]:
    """`sequences`, after checking every token id is one of the model's: a Choice sampled from
    another model, or ids built by hand, would index past the embedding (on a GPU a device-side
    assert that ends the process's CUDA context).

    Raises:
        TrajectoryError: naming the id and the vocabulary size.
    """
    for seq in sequences:
        if (bad := out_of_vocabulary(seq.token_ids, vocab_size)) is not None:
            raise TrajectoryError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size}): were its "
                                  "Choices sampled from another model? Sample them through model.openai_client()")
    return sequences
