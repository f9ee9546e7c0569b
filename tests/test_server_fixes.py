"""Regression tests: RULER's swallow_exceptions and repeated ids, a one-element `prompt` list on
/v1/completions, OpenAI's SFT `weight`, and streamed content before a tool call."""

import asyncio
import json

import openai
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

import tempering as art
from tempering.chat import ChatRenderer
from tempering.chat.tools import parse_tool_calls
from tempering.errors import TrajectoryError
from tempering.rewards.ruler import parse_scores, ruler_score_group
from tempering.service.base_model import default_model_dir
from tempering.service.chat_stream import StreamState
from tempering.service.schemas import CompletionRequest
from tempering.sft import read_sft_jsonl
from tempering.training.sft import sft_sequences


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


def test_swallow_exceptions_drops_a_group_whose_judge_request_fails():
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"},
                                                                      {"role": "assistant", "content": a}])
                                 for a in ("A", "B")])
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0, timeout=2)  # nothing listens
    assert asyncio.run(ruler_score_group(group, "judge", client=client, swallow_exceptions=True)) is None
    with pytest.raises(openai.APIConnectionError):
        asyncio.run(ruler_score_group(group, "judge", client=client))


def test_a_trajectory_scored_twice_is_a_bad_answer():
    answer = json.dumps({"scores": [{"trajectory_id": "1", "explanation": "", "score": 0.9},
                                    {"trajectory_id": "2", "explanation": "", "score": 0.5},
                                    {"trajectory_id": "1", "explanation": "", "score": 0.1}]})
    with pytest.raises(ValueError, match="'1' is scored more than once"):
        parse_scores(answer, 2)


def test_completions_take_a_list_of_one_prompt_but_not_a_batch():
    assert CompletionRequest(model="m", prompt=["Once upon a time"]).prompt == "Once upon a time"
    assert CompletionRequest(model="m", prompt=[[1, 2, 3]]).prompt == [1, 2, 3]
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompt == [1, 2, 3]
    for batch in (["a", "b"], [[1], [2]]):
        with pytest.raises(ValidationError, match="batched prompts are not supported"):
            CompletionRequest(model="m", prompt=batch)


def test_sft_weight_0_messages_are_context_only(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5, I think", "weight": 0},
                {"role": "user", "content": "Wrong. Again?"}, {"role": "assistant", "content": "4", "weight": 1}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    [trajectory] = read_sft_jsonl(path)
    [seq] = sft_sequences(trajectory, ChatRenderer(tokenizer), max_seq_len=4096)
    text = tokenizer.decode(seq.token_ids)
    assert tokenizer.decode([t for t, m in zip(seq.token_ids, seq.loss_mask) if m]) == "4<|im_end|>"
    assert "5, I think" in text and "weight" not in text  # context, and the key never reaches the template

    for bad, match in (({**messages[1], "weight": 0.5}, "message 1 has \"weight\": 0.5"),
                       ({**messages[1], "weight": 0}, "every assistant message has \"weight\": 0")):
        path.write_text(json.dumps({"messages": [*messages[:1], bad, *messages[2:3], {**messages[3], "weight": 0}]}) + "\n")
        with pytest.raises(TrajectoryError, match=match):
            read_sft_jsonl(path)
    unlearnable = art.Trajectory(messages_and_choices=[*messages[:3], {**messages[3], "weight": 0}])
    with pytest.raises(TrajectoryError, match="no assistant message to learn from"):
        sft_sequences(unlearnable, ChatRenderer(tokenizer), max_seq_len=4096)


def test_streamed_content_before_a_tool_call_equals_the_parsed_content(tokenizer):
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    for text, expected in (("Let me check. \n" + call, "Let me check."), (" Sure.\n\n" + call + "\nDone.\n", " Sure.\n\n\nDone.")):
        state = StreamState(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), prefix=None, tools_on=True, stop=[])
        streamed = "".join(state.push(t) for t in tokenizer.encode(text, add_special_tokens=False))
        content, calls = parse_tool_calls(text)
        assert calls and content == expected
        assert streamed + state.rest(content) == content
