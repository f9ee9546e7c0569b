import json

from tempering.chat.tools import forced_prefix, parse_tool_calls, tool_call_text, tools_system_prompt

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]


def test_a_hermes_call_becomes_an_openai_tool_call():
    content, calls = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert content == "Let me add."
    [call] = calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    assert call.to_openai()["type"] == "function" and call.id.startswith("call_")


def test_several_calls_string_arguments_and_a_missing_closing_tag_at_the_end():
    text = ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
            '<tool_call>\n{"name": "add", "arguments": {"b": 2}}\n')
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1}, {"b": 2}]


def test_malformed_or_unknown_calls_stay_plain_content():
    for text in (
        '<tool_call>\n{"name": "add", "arguments": 17}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "add", "arguments": {"a": 1</tool_call>',  # broken JSON
        '<tool_call>\n["add"]\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
    ):
        assert parse_tool_calls(text) == (text, [])
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, allowed={"add"}) == (text, [])
    assert parse_tool_calls("just text", allowed={"add"}) == ("just text", [])


def test_forced_prefixes_and_rendered_calls():
    assert forced_prefix("required") == "<tool_call>\n"
    assert forced_prefix({"type": "function", "function": {"name": "add"}}) == '<tool_call>\n{"name": "add", "arguments": '
    assert forced_prefix("auto") is None and forced_prefix("none") is None and forced_prefix(None) is None
    text = tool_call_text("add", '{"a": 1}')
    assert parse_tool_calls(text)[1][0].name == "add"
    # a call without arguments, sent back as "" (as some clients write it), renders as the model wrote it: {}
    assert {tool_call_text("now", args) for args in ("", " ", "{}", {})} == {tool_call_text("now", {})}
    assert parse_tool_calls(tool_call_text("now", ""))[1][0].arguments == "{}"
    prompt = tools_system_prompt(TOOLS)
    assert '"name": "add"' in prompt and "<tool_call>" in prompt
