"""Structured outputs on the OpenAI routes: the request's fields → one GrammarSpec (or none).

Accepted, at most one per request:
- OpenAI: `response_format={"type": "json_object"}` or `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": true}}` (`{"type": "text"}` constrains nothing). The
  schema is always enforced, `strict` or not.
- vLLM's body fields: `guided_json` (a schema), `guided_regex`, `guided_choice` (a list of
  strings), `guided_grammar` (Lark or GBNF); and its newer `structured_outputs={"json" | "regex" |
  "choice" | "grammar": ..., or "json_object": true}` (its whitespace options are accepted; JSON
  is always generated without free whitespace). A choice is returned whole: the request's `stop`
  strings and `stop_token_ids` are not applied to it (vLLM's would cut "nonstop" at "stop";
  openai_routes `_params`).
- `tool_choice="required"` or a named function (chat only): the assistant turn already starts
  with the Hermes call's opening (chat/tools.py `forced_prefix`); the grammar makes the rest a
  complete call of that function (or, for "required", of one of `tools`) whose arguments follow
  the tool's parameter schema, closed by `</tool_call>`.

Every problem is a ConfigError (HTTP 400) naming the field; so is a grammar that allows no output
at all (`compile_checked`).
"""

from __future__ import annotations

import re
from typing import Any

from ..chat.tools import TOOL_CALL_END
from ..engine.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from ..errors import ConfigError

__all__ = ["compile_checked", "request_spec", "tool_call_spec"]

MAX_CHOICES = 50_000  # llguidance panics past ~65k grammar symbols
_BACKTRACE = re.compile(r"\s*<backtrace>.*?</backtrace>", re.DOTALL)

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_VLLM_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}


def request_spec(body: Any) -> GrammarSpec | None:
    """The constraint a chat or completion request body asks for, or None.

    Raises:
        ConfigError: for an unknown `response_format` type, a malformed field, or more than one
            constraint in one request.
    """
    specs: list[tuple[str, GrammarSpec]] = []
    fmt = _response_format(getattr(body, "response_format", None))
    if fmt is not None:
        specs.append(("response_format", fmt))
    for name in _GUIDED:
        value = getattr(body, name, None)
        if value is not None:
            specs.append((name, _spec(name.removeprefix("guided_"), value, where=name)))
    outputs = getattr(body, "structured_outputs", None)
    if outputs is not None:
        spec = _structured_outputs(outputs)
        if spec is not None:
            specs.append(("structured_outputs", spec))
    if len(specs) > 1:
        raise ConfigError(f"send at most one output constraint per request; this one has {[n for n, _ in specs]}")
    return specs[0][1] if specs else None


def tool_call_spec(tools: list[dict[str, Any]], tool_choice: Any) -> GrammarSpec | None:
    """The rest of a forced tool call after `forced_prefix(tool_choice)`, or None for "auto"/"none".

    `tools` were checked by the route (each has a function with a string name; a named
    tool_choice names one of them).

    Raises:
        ConfigError: if a tool's `parameters` is not a JSON Schema object.
    """
    if tool_choice == "required":
        calls = []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            calls.append({
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": _parameters(fn, i)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return GrammarSpec.json_schema(schema, suffix="\n" + TOOL_CALL_END, where="tools (tool_choice 'required')")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        for i, tool in enumerate(tools):
            if tool["function"]["name"] == name:
                # the prefix ends in `"arguments": `: the arguments object, then the call's closing brace
                return GrammarSpec.json_schema(_parameters(tool["function"], i), suffix="}\n" + TOOL_CALL_END,
                                               where=f"tools[{i}].function.parameters")
    return None


def compile_checked(grammars: GrammarCompiler, spec: GrammarSpec) -> CompiledGrammar:
    """`grammars.compile(spec)`, refusing a grammar in which no output can start.

    Raises:
        ConfigError: as `compile` does (without llguidance's Rust backtrace), or when the first token
            can only end the sample: a JSON schema with no finite instance, such as {"$ref": "#"}.
    """
    try:
        compiled = grammars.compile(spec)
    except ConfigError as exc:
        raise ConfigError(_BACKTRACE.sub("", str(exc))) from None
    probe = compiled.matcher().inner  # a fresh copy; the lexer states its first mask builds are shared with the engine's
    probe.compute_bitmask()
    if probe.is_error() and not probe.is_accepting():
        raise ConfigError(f"{spec.where} has no finite instance: no output can satisfy it (e.g. a schema whose $ref "
                          "cycle has no way out); fix it")
    return compiled


def _parameters(fn: dict[str, Any], index: int) -> dict[str, Any]:
    params = fn.get("parameters")
    if params is None:  # OpenAI: no parameters means a function that takes none
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise ConfigError(f"tools[{index}].function.parameters must be a JSON Schema object")
    return params


def _response_format(fmt: Any) -> GrammarSpec | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise ConfigError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return GrammarSpec.json_schema(inner["schema"], where="response_format.json_schema.schema")
    raise ConfigError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')


def _structured_outputs(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict):
        raise ConfigError('structured_outputs must be an object like {"json": {...}} or {"choice": [...]}')
    unknown = set(value) - set(_VLLM_KEYS) - _VLLM_OPTIONS - {"json_object"}
    if unknown:
        raise ConfigError(f"structured_outputs keys {sorted(unknown)} are not supported; use one of "
                          f"{sorted(_VLLM_KEYS) + ['json_object']}")
    given = [k for k in _VLLM_KEYS if value.get(k) is not None] + (["json_object"] if value.get("json_object") else [])
    if len(given) > 1:
        raise ConfigError(f"structured_outputs must hold one constraint, got {given}")
    if not given:
        return None
    if given[0] == "json_object":
        return GrammarSpec.json_object(where="structured_outputs.json_object")
    return _spec(given[0], value[given[0]], where=f"structured_outputs.{given[0]}")


def _spec(kind: str, value: Any, *, where: str) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec.json_schema(value, where=where)
    if kind == "regex":
        return GrammarSpec.regex(value, where=where)
    if kind == "choice":
        if isinstance(value, list) and len(value) > MAX_CHOICES:
            raise ConfigError(f"{where} has {len(value)} choices; at most {MAX_CHOICES} are supported")
        return GrammarSpec.choice(value, where=where)
    return GrammarSpec.grammar(value, where=where)
