import math

import pytest
from openai.types.chat.chat_completion import Choice

from tempering.errors import TrajectoryError
from tempering.training.tokenize import tokenize_trajectory
from tempering.types import Trajectory


class FakeRenderer:
    """Renders each message as [role id, content ids...]; only used when a choice lacks prompt ids."""

    def render_prompt(self, messages, tools=None):
        ids = []
        for m in messages:
            ids += [900 + len(m["role"])] + [ord(c) for c in m["content"]]
        return ids + [999]


def choice(token_ids, logprobs, *, prompt_token_ids=None, temperature=None, content="x"):
    data = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": content},
        "logprobs": {"content": [{"token": "t", "logprob": lp, "bytes": [], "top_logprobs": []} for lp in logprobs]},
        "token_ids": token_ids,
    }
    if prompt_token_ids is not None:
        data["prompt_token_ids"] = prompt_token_ids
    if temperature is not None:
        data["logprob_temperature"] = temperature
    return Choice.model_validate(data)


def test_single_turn_masks_exactly_the_sampled_tokens():
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice([7, 8, 2], [-0.1, -0.2, -0.3], prompt_token_ids=[1, 5, 6])])
    [seq] = tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)
    assert seq.token_ids == [1, 5, 6, 7, 8, 2]
    assert seq.loss_mask == [False, False, False, True, True, True]
    assert seq.sampled_logprobs[3:] == [-0.1, -0.2, -0.3]
    assert all(math.isnan(x) for x in seq.sampled_logprobs[:3])
    assert seq.num_completion_tokens == 3


def test_turns_merge_when_the_next_prompt_extends_the_sequence():
    first = choice([7, 2], [-0.5, -0.6], prompt_token_ids=[1, 5], temperature=0.7)
    second = choice([9, 2], [-0.7, -0.8], prompt_token_ids=[1, 5, 7, 2, 3, 4], temperature=1.0)
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "a"}, first, {"role": "user", "content": "b"}, second])
    [seq] = tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)
    assert seq.token_ids == [1, 5, 7, 2, 3, 4, 9, 2]
    assert seq.loss_mask == [False, False, True, True, False, False, True, True]
    assert seq.temperatures == [1.0, 1.0, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0]  # each turn keeps its own
    assert seq.num_completion_tokens == 4


def test_a_rewritten_history_starts_a_new_sequence_with_its_exact_prompt():
    first = choice([7, 2], [-0.5, -0.6], prompt_token_ids=[1, 5])
    second = choice([9, 2], [-0.7, -0.8], prompt_token_ids=[1, 5, 70, 2, 3])  # 70: turn 1 re-tokenized differently
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "a"}, first, second])
    seqs = tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)
    assert [s.token_ids for s in seqs] == [[1, 5, 7, 2], [1, 5, 70, 2, 3, 9, 2]]
    assert [s.loss_mask for s in seqs] == [[False, False, True, True], [False] * 5 + [True, True]]


def test_choice_without_prompt_ids_is_rendered_and_vllm_token_format_is_read():
    c = Choice.model_validate({
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"},
        "logprobs": {"content": [{"token": "token_id:42", "logprob": -1.0, "bytes": [], "top_logprobs": []}]},
    })
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "a"}, c])
    [seq] = tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)
    assert seq.token_ids == [904, 97, 999, 42]
    assert seq.loss_mask == [False, False, False, True]


def test_additional_histories_become_their_own_sequences():
    t = Trajectory(
        messages_and_choices=[choice([3], [-1.0], prompt_token_ids=[1])],
        additional_histories=[{"messages_and_choices": [choice([4], [-2.0], prompt_token_ids=[2])]}],
    )
    seqs = tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)
    assert [s.token_ids for s in seqs] == [[1, 3], [2, 4]]


def test_trajectory_without_a_sampled_choice_is_an_error():
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(TrajectoryError, match="Append the Choice object itself"):
        tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)


def test_a_trajectory_with_no_assistant_turn_has_no_sequences():
    # ART's self-play tic-tac-toe: X's invalid first move ends the game before O's first turn
    t = Trajectory(messages_and_choices=[{"role": "system", "content": "You are O."}], reward=1.0)
    assert tokenize_trajectory(t, FakeRenderer(), max_seq_len=100) == []


def test_an_assistant_turn_appended_as_the_choice_message_is_still_an_error():
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "a"}])
    t.messages_and_choices.append(choice([7], [-0.1], prompt_token_ids=[1]).message)  # ART #336: not the Choice
    with pytest.raises(TrajectoryError, match="Append the Choice object itself"):
        tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)


def test_choice_without_logprobs_is_an_error():
    c = Choice.model_validate({"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "b"}})
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "a"}, c])
    with pytest.raises(TrajectoryError, match="no sampled logprobs"):
        tokenize_trajectory(t, FakeRenderer(), max_seq_len=100)


def test_too_long_sequence_is_an_error():
    t = Trajectory(messages_and_choices=[choice([3, 4], [-1.0, -1.0], prompt_token_ids=[1, 2, 3])])
    with pytest.raises(TrajectoryError, match="context is 4"):
        tokenize_trajectory(t, FakeRenderer(), max_seq_len=4)
