import copy

import pytest

from tempering.chat import ChatRenderer, TurnCache

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}}]

# A template that renders tools and assistant tool calls itself, in the Hermes/Qwen style.
NATIVE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:{{ c.function.arguments.a }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_a_template_that_ignores_tools_gets_them_in_the_system_prompt(tokenizer):
    renderer = ChatRenderer(tokenizer)
    assert not renderer.template_renders_tools
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    text = renderer.render_text(messages, TOOLS)
    assert text.startswith("<|im_start|>system\nYou can call functions.") and '"name": "add"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>" in text
    assert renderer.render_text(messages[:1], TOOLS, tool_choice="none") == renderer.render_text(messages[:1], TOOLS)
    assert renderer.render_text(messages[:1], TOOLS, tool_choice="required").endswith("<|im_start|>assistant\n<tool_call>\n")


def test_a_template_that_renders_tools_gets_them_and_decoded_arguments(tokenizer):
    saved = tokenizer.chat_template
    tokenizer.chat_template = NATIVE
    try:
        renderer = ChatRenderer(tokenizer)
        assert renderer.template_renders_tools
        text = renderer.render_text([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": '{"a": 5}'}}]},
        ], TOOLS)
        assert text.startswith("<|im_start|>system\nTOOLS:add;") and "<tool_call>add:5</tool_call>" in text
    finally:
        tokenizer.chat_template = saved


def test_the_turn_cache_gives_back_the_sampled_ids_not_a_retokenization(tokenizer):
    renderer = ChatRenderer(tokenizer)
    turns = TurnCache(tokenizer)
    messages = [{"role": "user", "content": "say hello"}]
    prompt = renderer.render_prompt(messages, turns=turns)
    # the model spelled "hello" letter by letter, then ended its turn: a spelling re-tokenization never gives
    completion = [tokenizer.convert_tokens_to_ids(c) for c in "hello"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert tokenizer("hello", add_special_tokens=False)["input_ids"] != completion[:-1]
    turns.remember(prompt, completion, "hello", "hello", [])
    follow_up = messages + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    ids = renderer.render_prompt(follow_up, turns=turns)
    assert ids[: len(prompt) + len(completion)] == prompt + completion
    assert tokenizer.decode(ids) == renderer.render_text(follow_up)
    # without the cache the same text is re-tokenized, differently
    assert renderer.render_prompt(follow_up)[: len(prompt) + len(completion)] != prompt + completion


def test_a_prompt_sent_again_is_tokenized_once_and_the_oldest_texts_are_forgotten(tokenizer):
    calls = []

    class Counting:
        def __call__(self, text, **kwargs):
            calls.append(text)
            return tokenizer(text, **kwargs)

    turns = TurnCache(Counting(), text_capacity=2)
    texts = ["an RL group's prompt", "another prompt", "a third"]
    first = turns.tokenize(texts[0])
    assert first == tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    for _ in range(7):  # the group's other rollouts send the same prompt
        ids = turns.tokenize(texts[0])
        assert ids == first and ids is not first  # a list of its own each time
    assert calls == [texts[0]]
    turns.tokenize(texts[1]), turns.tokenize(texts[2])  # the first is now the oldest of three: forgotten
    turns.tokenize(texts[0])
    assert calls == [texts[0], texts[1], texts[2], texts[0]]


def test_prompts_that_share_a_system_turn_tokenize_it_once_and_get_the_whole_texts_ids(tokenizer):
    calls = []

    class Counting:
        added_tokens_decoder = tokenizer.added_tokens_decoder

        def __call__(self, text, **kwargs):
            calls.append(text)
            return tokenizer(text, **kwargs)

    turns = TurnCache(Counting())
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "system", "content": "You are an agent. " * 50}, {"role": "user", "content": "go  on\n "}]
    system = renderer.render_text(messages[:1], TOOLS)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):  # a group's first turns
        text = renderer.render_text(messages, TOOLS, tool_choice=choice)
        assert turns.tokenize(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    # the probe, then each piece once: the system turn (up to its <|im_end|>) is not tokenized again
    pieces = [c for c in calls[2:] for c in ([c] if isinstance(c, str) else c)]
    assert len([p for p in pieces if "You are an agent." in p]) == 1
    assert system.startswith(pieces[0]) and pieces[0].endswith("</tool_call>")


def test_a_text_is_not_cut_before_a_token_that_strips_the_whitespace_before_it(tokenizer):
    from tokenizers import AddedToken

    class Stripping:
        def __init__(self, **im_end) -> None:  # <|im_end|> (id 2) as it would be added with these options
            self.added_tokens_decoder = {**tokenizer.added_tokens_decoder,
                                         2: AddedToken("<|im_end|>", normalized=False, special=True, **im_end)}

        def __call__(self, text, **kwargs):
            return tokenizer(text, **kwargs)

    turns = TurnCache(Stripping(lstrip=True))
    text = "<|im_start|>user\nhi <|im_end|>\n<|im_start|>assistant\n"
    assert turns.tokenize(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert list(turns._texts) == ["<|im_start|>user\nhi <|im_end|>\n", "<|im_start|>assistant\n"]
    # a token matched only as a whole word depends on the character before it: no text is cut
    assert TurnCache(Stripping(single_word=True))._pieces is None


def test_the_end_of_turn_is_the_stop_id_the_template_closes_an_assistant_turn_with(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # SmolLM2's generation config's eos_token_id
    # transformers 5.24 converts SmolLM2's GGUF with <|im_end|> as the tokenizer's EOS, 5.17 with <|im_start|>
    for eos in ("<|im_end|>", "<|im_start|>"):
        converted = copy.deepcopy(tokenizer)
        converted.eos_token = eos
        renderer = ChatRenderer(converted, stop_token_ids=[im_end])
        assert renderer.end_of_turn_id == im_end, eos
    assert renderer.stop_token_ids == [1, 2]
    # with <|im_start|> alone as a stop id the template ends no turn on a stop id: the tokenizer's EOS
    assert ChatRenderer(converted).end_of_turn_id == 1
