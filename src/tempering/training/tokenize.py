"""Trajectories → token sequences with a loss mask, sampled logprobs and advantages.

Each assistant `Choice` sampled by tempering carries the exact ids it was sampled from
(`choice.prompt_token_ids`) and the ids it sampled (`choice.token_ids`), with their logprobs. A
choice becomes a segment `prompt + completion`; the completion ids are trained (loss mask 1), the
prompt ids are context (mask 0). Completion ids are never re-tokenized.

Segments of one conversation merge into one sequence when each later prompt starts with the
whole earlier sequence (multi-turn with a prefix-preserving template). When it does not (the
template rewrote history, or the client edited messages), the later turn starts a new sequence
with its own exact prompt, so every trained token is still scored in the context it was
sampled in.

A trajectory with no assistant turn at all has no tokens: it still counts in its group's reward
statistics (the service computes advantages over every trajectory), but adds no sequence. ART's
self-play tic-tac-toe makes one whenever the first move loses the game: the other player's
trajectory holds only its system prompt. A trajectory whose assistant turns are all message dicts
(`choice.message` or a dict appended instead of the Choice, ART #336) is refused: its tokens are
unknown, and training would silently skip what the user meant to train.

A choice sampled under a grammar (structured outputs) carries `grammar_forced`: per sampled
token, whether the grammar allowed only that token. Those flags are kept per token
(`TokenizedSequence.forced`), and with `exclude_forced_tokens` such tokens leave the loss: the
model made no choice there (under the constrained policy their probability is 1 whatever the
weights), so they carry no signal about the decision the reward judged.

A choice of a mixture of experts may carry `routed_experts` (modeling/routing_format.py): the
experts each of its tokens but the last was routed to when it was sampled. They are kept per
token (`TokenizedSequence.routed_experts`) so that the trainer routes the same way (routing
replay); a later turn's choice covers the whole merged sequence, earlier turns included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..chat import ChatRenderer
from ..errors import TrajectoryError
from ..modeling.routing_format import decode_routed_experts
from ..types import Choice, History, Trajectory, choice_to_message

__all__ = ["TokenizedSequence", "tokenize_trajectory"]


@dataclass(slots=True)
class TokenizedSequence:
    """One training sequence of T tokens.

    Attributes:
        token_ids: [T] ids.
        loss_mask: [T] True where the token was sampled by the policy (trained on).
        sampled_logprobs: [T] logprob of each sampled token at sampling time (nan elsewhere).
        temperatures: [T] the temperature each sampled token's logprob was computed at (the trainer
            divides the logits by it); 1 on other tokens. None means 1 everywhere.
        advantage: the trajectory's advantage, the same for all of its tokens.
        forced: [T] True where a sampled token was the only one its grammar allowed (structured
            outputs); None when no choice of the sequence was constrained.
        routed_experts: [T, L_moe, k] int16, the experts each token was routed to when sampled
            (-1 where unknown, e.g. the last token); None when no choice carried them.
        exact_logprobs: [T] the engine's own recomputation of each trained token's logprob under
            the current weights (nan elsewhere), set by the trainer before an update when the
            engine is batch-invariant (`Trainer.step(scorer=...)`); None otherwise.
        on_policy: every sampled token of it was sampled with the weights the training step starts
            from (the tokens' policy versions are the step's): with a batch-invariant engine its
            sampled logprobs are then those weights' exact values, and need no rescoring.
    """

    token_ids: list[int]
    loss_mask: list[bool]
    sampled_logprobs: list[float]
    temperatures: list[float] | None = None
    advantage: float = 0.0
    group_index: int = 0
    trajectory_index: int = 0
    forced: list[bool] | None = None
    routed_experts: np.ndarray | None = None
    exact_logprobs: list[float] | None = None
    on_policy: bool = False
    num_completion_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.temperatures is None:
            self.temperatures = [1.0] * len(self.token_ids)
        assert len(self.token_ids) == len(self.loss_mask) == len(self.sampled_logprobs) == len(self.temperatures)
        assert self.forced is None or len(self.forced) == len(self.token_ids)
        assert self.routed_experts is None or len(self.routed_experts) == len(self.token_ids)
        self.num_completion_tokens = sum(self.loss_mask)

    def exclude_forced(self) -> None:
        """Take the grammar-forced tokens out of the loss (they stay in the sequence as context)."""
        if self.forced is None:
            return
        for t, is_forced in enumerate(self.forced):
            if is_forced and self.loss_mask[t]:
                self.loss_mask[t] = False
                self.sampled_logprobs[t] = math.nan
        self.num_completion_tokens = sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.token_ids)


def completion_ids_and_logprobs(choice: Choice) -> tuple[list[int], list[float]]:
    """The sampled ids and their logprobs of a choice.

    The logprobs are the tempering server's `choice.sampled_logprobs`, or else OpenAI's
    `choice.logprobs.content[i].logprob` (a choice from a vLLM server, or saved by an older
    tempering); the ids are `choice.token_ids`, or else vLLM's `"token_id:123"` token strings.

    Raises:
        TrajectoryError: if the choice has no logprobs or no token ids.
    """
    content = choice.logprobs.content if choice.logprobs is not None else None
    logprobs = getattr(choice, "sampled_logprobs", None)
    if logprobs is None and content:
        logprobs = [c.logprob for c in content]
    if not logprobs:
        raise TrajectoryError(
            "an assistant Choice has no sampled logprobs; only choices returned by a tempering server "
            "(`choice.sampled_logprobs`) or by vLLM with logprobs on can be trained on"
        )
    logprobs = [float(lp) for lp in logprobs]
    token_ids = getattr(choice, "token_ids", None)
    if token_ids is None:  # vLLM's return_tokens_as_token_ids format: "token_id:123"
        if content and all(c.token.startswith("token_id:") for c in content):
            token_ids = [int(c.token.split(":", 1)[1]) for c in content]
        else:
            raise TrajectoryError(
                "an assistant Choice has logprobs but no token ids (choice.token_ids); "
                "sample it through model.openai_client() so the exact ids are returned"
            )
    if len(token_ids) != len(logprobs):
        raise TrajectoryError(f"a Choice has {len(token_ids)} token ids but {len(logprobs)} logprobs")
    if not all(math.isfinite(lp) for lp in logprobs):
        raise TrajectoryError("a Choice has a non-finite sampled logprob")
    return [int(i) for i in token_ids], logprobs


def grammar_forced(choice: Choice, num_tokens: int) -> list[bool] | None:
    """The choice's per-token `grammar_forced` flags (None for a free choice).

    Raises:
        TrajectoryError: if there is not one flag per sampled token.
    """
    forced = getattr(choice, "grammar_forced", None)
    if forced is None:
        return None
    if len(forced) != num_tokens:
        raise TrajectoryError(f"a Choice has {num_tokens} token ids but {len(forced)} grammar_forced flags")
    return [bool(f) for f in forced]


def routed_experts(choice: Choice, num_tokens: int) -> np.ndarray | None:
    """The choice's routed experts as [num_tokens, L, k] int16 (its last row -1), or None.

    Raises:
        TrajectoryError: if they are malformed or not one row per token of prompt + completion but the last.
    """
    value = getattr(choice, "routed_experts", None)
    if value is None:
        return None
    try:
        ids = decode_routed_experts(value)
    except ValueError as exc:
        raise TrajectoryError(f"a Choice has {exc}") from exc
    if len(ids) != num_tokens - 1:
        raise TrajectoryError(f"a Choice of {num_tokens} prompt and completion tokens has routed experts for "
                              f"{len(ids)}; expected {num_tokens - 1}")
    return np.concatenate([ids, np.full((1, *ids.shape[1:]), -1, dtype=np.int16)])


def _unknown_routing(like: np.ndarray, num_tokens: int) -> np.ndarray:
    return np.full((num_tokens, *like.shape[1:]), -1, dtype=np.int16)


def _segments(history: History, renderer: ChatRenderer) -> list[tuple[list[int], list[int], list[float], float,
                                                                       list[bool] | None, Choice]]:
    """(prompt ids, completion ids, completion logprobs, temperature, forced flags, the choice) of each trainable choice."""
    segments = []
    items = history.messages_and_choices
    for i, item in enumerate(items):
        if not isinstance(item, Choice):
            continue
        completion, logprobs = completion_ids_and_logprobs(item)
        prompt = getattr(item, "prompt_token_ids", None)
        if prompt is None:
            earlier = [choice_to_message(m) if isinstance(m, Choice) else m for m in items[:i]]
            prompt = renderer.render_prompt(earlier, history.tools)
        temperature = float(getattr(item, "logprob_temperature", None) or 1.0)
        segments.append(([int(t) for t in prompt], completion, logprobs, temperature, grammar_forced(item, len(completion)),
                         item))
    return segments


def has_assistant_turn(trajectory: Trajectory) -> bool:
    """Whether any history of the trajectory holds an assistant turn: a Choice, or an assistant
    message (a dict, or an object such as `choice.message` appended to the list as it is)."""
    def role(item) -> str | None:
        return item.get("role") if isinstance(item, dict) else getattr(item, "role", None)

    return any(isinstance(item, Choice) or role(item) == "assistant"
               for history in trajectory.histories() for item in history.messages_and_choices)


def tokenize_trajectory(trajectory: Trajectory, renderer: ChatRenderer, *, max_seq_len: int,
                        exclude_forced_tokens: bool = False, routing_replay: bool = True) -> list[TokenizedSequence]:
    """The training sequences of one trajectory (its main history and `additional_histories`).

    With `exclude_forced_tokens`, tokens that a grammar forced get loss mask 0 (see the module doc);
    with `routing_replay` (default), the choices' routed experts are kept for the trainer to replay.

    Returns:
        the sequences; none for a trajectory with no assistant turn at all (see the module doc).

    Raises:
        TrajectoryError: if the trajectory has assistant turns but no Choice with logprobs among
            them (dicts appended instead of Choices), if a choice lacks token ids, or if a
            sequence is longer than `max_seq_len`.
    """
    sequences: list[TokenizedSequence] = []
    for history in trajectory.histories():
        current: TokenizedSequence | None = None
        for prompt, completion, logprobs, temperature, forced, choice in _segments(history, renderer):
            routed = routed_experts(choice, len(prompt) + len(completion)) if routing_replay else None
            if current is not None and prompt[: len(current.token_ids)] == current.token_ids:
                extra = prompt[len(current.token_ids):]
                if routed is not None:  # this choice's routing covers the whole merged sequence
                    current.routed_experts = routed
                elif current.routed_experts is not None:
                    current.routed_experts = np.concatenate(
                        [current.routed_experts, _unknown_routing(current.routed_experts, len(extra) + len(completion))])
                if forced is not None and current.forced is None:
                    current.forced = [False] * len(current.token_ids)
                if current.forced is not None:
                    current.forced += [False] * len(extra) + (forced or [False] * len(completion))
                current.token_ids += extra + completion
                current.loss_mask += [False] * len(extra) + [True] * len(completion)
                current.sampled_logprobs += [math.nan] * len(extra) + logprobs
                current.temperatures += [1.0] * len(extra) + [temperature] * len(completion)
                current.num_completion_tokens += len(completion)
                continue
            current = TokenizedSequence(
                token_ids=prompt + completion,
                loss_mask=[False] * len(prompt) + [True] * len(completion),
                sampled_logprobs=[math.nan] * len(prompt) + logprobs,
                temperatures=[1.0] * len(prompt) + [temperature] * len(completion),
                forced=[False] * len(prompt) + forced if forced is not None else None,
                routed_experts=routed,
            )
            sequences.append(current)
    if not sequences and has_assistant_turn(trajectory):
        raise TrajectoryError(
            "a trajectory has no assistant Choice with logprobs, so there is nothing to train on. "
            "Append the Choice object itself (completion.choices[0]) to messages_and_choices, "
            "not choice.message or a dict"
        )
    for seq in sequences:
        if exclude_forced_tokens:
            seq.exclude_forced()
        if len(seq) > max_seq_len:
            raise TrajectoryError(f"a trajectory has a sequence of {len(seq)} tokens; the model's context is {max_seq_len}")
    return sequences
