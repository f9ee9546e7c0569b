"""OpenAI's `logprobs` fields of a response: per token its text, bytes and top alternatives.

A token's text is decoded alone, and its bytes are the raw bytes it stands for (a token can hold
part of a UTF-8 character, whose text is then U+FFFD), from the tokenizer's byte-level alphabet
(GPT-2's) or SentencePiece's byte fallback.
"""

from __future__ import annotations

import codecs
import functools
import re
from typing import Any

from ..engine import Completion
from ..engine.grammar.compiler import holds_byte_level

__all__ = ["chat_logprob", "completion_logprobs", "logprob_entry", "token_decoder"]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE (GPT-2's alphabet): the character that stands for each byte in the vocabulary → the byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class _TokenDecoder:
    """A request's per-token texts (`decode(id)`) and raw bytes (`decode.bytes(id)`: a token can hold
    part of a UTF-8 character, whose text is then U+FFFD), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = list(self._raw(token_id))
        return data

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the vocabulary spells tokens in GPT-2's byte alphabet: a ByteLevel decoder, alone
        or inside a Sequence (transformers 5.17 converts a GGUF's GPT-2-style tokenizer with
        [ByteFallback, Fuse, Replace, ByteLevel]; 5.24 with ByteLevel alone)."""
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        return decoder is not None and holds_byte_level(decoder)

    @functools.cached_property
    def _added(self) -> dict[int, Any]:
        return self.tokenizer.added_tokens_decoder  # stored as plain text, also in a byte-level vocabulary

    def _raw(self, token_id: int) -> bytes:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(token, str):
            if self._byte_level and token_id not in self._added:
                try:
                    return bytes(_byte_decoder()[ch] for ch in token)
                except KeyError:
                    pass
            if match := _BYTE_TOKEN.fullmatch(token):
                return bytes([int(match.group(1), 16)])
        return self(token_id).encode("utf-8")


def token_decoder(tokenizer: Any) -> _TokenDecoder:
    """A request's decoder of token ids: `decode(id)` -> text, `decode.bytes(id)` -> list of bytes."""
    return _TokenDecoder(tokenizer)


def logprob_entry(decode, token_id: int, logprob: float, top: list[tuple[int, float]], num_top: int) -> dict[str, Any]:
    """One token's entry of a chat `logprobs.content`: its text, logprob (nats), bytes and top alternatives."""
    return {
        "token": decode(token_id),
        "logprob": logprob,
        "bytes": decode.bytes(token_id),
        "top_logprobs": [
            {"token": decode(a), "logprob": lp, "bytes": decode.bytes(a)} for a, lp in top
        ] if num_top else [],
    }


def completion_logprobs(decode, c: Completion, num_top: int) -> dict[str, Any]:
    """The legacy completions API's `logprobs` object of one choice."""
    tokens = [decode(t) for t in c.token_ids]
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, pos = [], 0
    for t in c.token_ids:  # a character split over tokens counts at its last token
        offsets.append(pos)
        pos += len(utf8.decode(bytes(decode.bytes(t))))
    return {
        "tokens": tokens,
        "token_logprobs": c.logprobs,
        "top_logprobs": [{decode(a): lp for a, lp in top} for top in c.top_logprobs] if num_top else None,
        "text_offset": offsets,
    }


def chat_logprob(decode, c: Completion, t: int, num_top: int) -> dict[str, Any]:
    """The entry of the choice's token `t` (`logprob_entry`)."""
    return logprob_entry(decode, c.token_ids[t], c.logprobs[t], c.top_logprobs[t], num_top)
