"""What a request's output must match: a JSON schema, a regex, one of some strings, or a grammar.

A `GrammarSpec` is plain, hashable data (the compiled-grammar cache is keyed by it) and needs no
grammar library; `compiler.py` turns it into a matcher. The request surface (OpenAI's
`response_format`, vLLM's `guided_*` and `structured_outputs`, forced tool calls) is translated
into specs by the service (`service/structured.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ...errors import ConfigError

__all__ = ["GrammarSpec"]

Kind = Literal["json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the sampled text.

    Attributes:
        kind: "json_schema" (`text` is the schema as JSON), "regex" (`text` is the pattern, Rust
            `regex` syntax, which is Python's for the common cases), "choice" (`text` is a JSON
            list of the allowed strings) or "grammar" (`text` is a Lark or GBNF/EBNF grammar, as
            vLLM accepts).
        text: see `kind`.
        suffix: literal text that must follow the match (the closing of a forced tool call),
            only with "json_schema".
        where: how the request named it (for error messages), e.g. "response_format".

    Build specs with the classmethods; they raise ConfigError for values of the wrong type.
    """

    kind: Kind
    text: str
    suffix: str = ""
    where: str = field(default="the request", compare=False)  # not part of the cache key

    def __post_init__(self) -> None:
        if self.suffix and self.kind != "json_schema":
            raise ConfigError(f"a grammar suffix is only supported after a JSON schema, not after {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: Any, *, suffix: str = "", where: str = "json schema") -> GrammarSpec:
        """A JSON value valid under `schema` (a dict, a JSON string of one, or `true`).

        Raises:
            ConfigError: if `schema` is not an object (or `true`), or is a string that does not parse.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where} is not valid JSON ({exc}); send the schema as a JSON object") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ConfigError(
                f"{where} must be a JSON Schema object (or true), got {type(schema).__name__} {json.dumps(schema)[:80]}"
            )
        # key order is kept: it is the order the properties are generated in
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), suffix, where)

    @classmethod
    def json_object(cls, *, where: str = "response_format") -> GrammarSpec:
        """Any JSON object (OpenAI's `response_format={"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"}, where=where)

    @classmethod
    def regex(cls, pattern: Any, *, where: str = "regex") -> GrammarSpec:
        """Text matching the whole of `pattern`.

        Raises:
            ConfigError: if `pattern` is not a non-empty string (its syntax is checked on compile).
        """
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{where} must be a non-empty regular expression string, got {pattern!r}")
        return cls("regex", pattern, where=where)

    @classmethod
    def choice(cls, choices: Any, *, where: str = "choice") -> GrammarSpec:
        """Exactly one of `choices` (a non-empty list of non-empty strings).

        Raises:
            ConfigError: for an empty list, a non-list, or an item that is not a non-empty string.
        """
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where} must be a non-empty list of strings, got {json.dumps(choices)[:80]}")
        bad = [c for c in choices if not isinstance(c, str) or not c]
        if bad:
            raise ConfigError(f"{where} must hold only non-empty strings; {json.dumps(bad[0])[:80]} is not one")
        return cls("choice", json.dumps(choices, ensure_ascii=False), where=where)

    @classmethod
    def grammar(cls, text: Any, *, where: str = "grammar") -> GrammarSpec:
        """Text in the language of a Lark or GBNF grammar (its syntax is checked on compile).

        Raises:
            ConfigError: if `text` is not a non-empty string.
        """
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where} must be a non-empty Lark or GBNF grammar string")
        return cls("grammar", text, where=where)

    @property
    def choices(self) -> list[str]:
        """The allowed strings of a "choice" spec."""
        assert self.kind == "choice"
        return json.loads(self.text)
