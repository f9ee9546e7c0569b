"""Supervised fine-tuning: assistant messages → token sequences → cross-entropy steps.

Each assistant message is rendered with the chat template; its tokens (up to and including the
end-of-turn token) are trained, everything else is context. An assistant message with
`"weight": 0` (OpenAI's chat fine-tuning format) is context too; the key never reaches the
template. Turns of one conversation share a sequence while each prompt extends the previous one
(the usual case); otherwise a turn starts a sequence of its own. The step reuses the RL trainer's
pieces (packing, chunked logprobs, gradient checkpointing) with the loss `-logprob`, averaged over
a batch's trained tokens.
"""

from __future__ import annotations

import math
import random
from typing import Any

from ..chat import ChatRenderer
from ..errors import TrajectoryError
from ..types import TrainSFTConfig, Trajectory
from .tokenize import TokenizedSequence

__all__ = ["message_weight", "sft_batches", "sft_sequences"]


def message_weight(message: dict[str, Any], index: int) -> int:
    """Message `index`'s `weight` (OpenAI's chat fine-tuning format): 1 (learn from it, the default) or 0.

    Raises:
        TrajectoryError: if the weight is not 0 or 1.
    """
    weight = message.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise TrajectoryError(f'SFT message {index} has "weight": {weight!r}; it must be 0 (context only) '
                              "or 1 (learn from it)")
    return int(weight)


def sft_sequences(trajectory: Trajectory, renderer: ChatRenderer, *, max_seq_len: int) -> list[TokenizedSequence]:
    """The training sequences of one conversation's assistant messages (those of weight 1).

    Raises:
        TrajectoryError: if there is no assistant message of weight 1, a weight is not 0 or 1, the
            template does not render a turn as a continuation of its prompt, or a sequence is longer
            than `max_seq_len`.
    """
    stops = set(renderer.stop_token_ids)
    out: list[TokenizedSequence] = []
    for history in trajectory.histories():
        messages, tools = history.messages(), history.tools
        weights = [message_weight(m, i) for i, m in enumerate(messages)]
        messages = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
        current: TokenizedSequence | None = None
        for i, message in enumerate(messages):
            if message.get("role") != "assistant" or not weights[i]:
                continue
            prompt = renderer.render_prompt(messages[:i], tools)
            full = renderer.render_conversation(messages[: i + 1], tools)
            if full[: len(prompt)] != prompt:
                raise TrajectoryError(f"the chat template does not render assistant message {i} after its prompt")
            completion = full[len(prompt):]
            end = next((j + 1 for j, t in enumerate(completion) if t in stops), len(completion))
            completion = completion[:end]  # through the end-of-turn token, not the template's newline after it
            if current is not None and prompt[: len(current.token_ids)] == current.token_ids:
                extra = prompt[len(current.token_ids):]
                current.token_ids += extra + completion
                current.loss_mask += [False] * len(extra) + [True] * len(completion)
                current.sampled_logprobs += [math.nan] * (len(extra) + len(completion))
                current.temperatures += [1.0] * (len(extra) + len(completion))
                current.num_completion_tokens += len(completion)
            else:
                current = TokenizedSequence(prompt + completion, [False] * len(prompt) + [True] * len(completion),
                                            [math.nan] * (len(prompt) + len(completion)))
                out.append(current)
    if not out:
        raise TrajectoryError("an SFT trajectory has no assistant message to learn from "
                              '(one with "weight": 0 is context only); give it one of weight 1')
    for seq in out:
        if len(seq) > max_seq_len:
            raise TrajectoryError(f"an SFT conversation has {len(seq)} tokens; the model's context is {max_seq_len}")
    return out


def sft_batches(per_trajectory: list[list[TokenizedSequence]], config: TrainSFTConfig, rng: random.Random) -> list[tuple[list[TokenizedSequence], float]]:
    """(sequences, learning rate) of each optimizer update: `epochs` passes in batches of whole trajectories."""
    size = config.resolved_batch_size()
    batches: list[list[TokenizedSequence]] = []
    for _ in range(config.epochs):
        order = list(range(len(per_trajectory)))
        if config.shuffle:
            rng.shuffle(order)
        for start in range(0, len(order), size):
            batches.append([s for i in order[start:start + size] for s in per_trajectory[i]])
    rates: Any = config.learning_rate
    if isinstance(rates, list):
        if len(rates) < len(batches):
            raise TrajectoryError(f"learning_rate lists {len(rates)} values but the call has {len(batches)} batches")
        return list(zip(batches, rates))
    return [(b, rates) for b in batches]
