"""Supervised fine-tuning: assistant messages → token sequences → cross-entropy steps.

Each assistant message is rendered with the chat template; its tokens (up to and including the
end-of-turn token) are trained, everything else is context. Turns of one conversation share a
sequence while each prompt extends the previous one (the usual case); otherwise a turn starts a
sequence of its own. The step reuses the RL trainer's pieces (packing, chunked logprobs,
gradient checkpointing) with the loss `-logprob`, averaged over a batch's trained tokens.
"""

from __future__ import annotations

import math
import random
from typing import Any

from ..chat import ChatRenderer
from ..errors import TrajectoryError
from ..types import TrainSFTConfig, Trajectory
from .tokenize import TokenizedSequence

__all__ = ["sft_batches", "sft_sequences"]


def sft_sequences(trajectory: Trajectory, renderer: ChatRenderer, *, max_seq_len: int) -> list[TokenizedSequence]:
    """The training sequences of one conversation's assistant messages.

    Raises:
        TrajectoryError: if there is no assistant message, the template does not render a turn as
            a continuation of its prompt, or a sequence is longer than `max_seq_len`.
    """
    stops = set(renderer.stop_token_ids)
    out: list[TokenizedSequence] = []
    for history in trajectory.histories():
        messages, tools = history.messages(), history.tools
        current: TokenizedSequence | None = None
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
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
        raise TrajectoryError("an SFT trajectory has no assistant message to learn from")
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
