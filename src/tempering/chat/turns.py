"""Exact token ids of sampled turns, for the requests that continue their conversations.

An agent sends its whole conversation back with every request, as text. Re-tokenizing an
earlier assistant turn can give other ids than the ones the engine sampled (BPE has many ways to
spell a string), and tool calls come back re-serialized. `TurnCache` remembers, for each recent
completion, the exact prompt + completion ids and their text; when a new conversation's rendered
text starts with that text, the new prompt reuses those ids and only tokenizes what follows. The
model then sees exactly what it produced, the engine's prefix cache hits, and the trainer can
merge the turns into one sequence.

It also remembers the ids of recently tokenized texts: an RL group's rollouts send the same
prompt n times, and tokenizing it was a quarter of the server's work on a gather of 256 rollouts.
A text is remembered in pieces, each starting at a special token (`<|im_start|>`): prompts that
share a system turn but differ after it (an agent's first turns, whose forced tool call differs
between the rollouts of a group) tokenize the shared turn once. The tokenizer splits a text at its
special tokens before anything else and encodes the pieces apart, so the pieces' ids, joined, are
the text's ids; `_piece_pattern` checks that of the tokenizer at hand, and a tokenizer where it
may not hold (a special token that strips the whitespace before it, one matched as a single word
only, or a probe text whose ids differ) gets whole texts only.
"""

from __future__ import annotations

import array
import collections
import re
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["TurnCache"]


@dataclass(slots=True)
class _Turn:
    ids: array.array  # prompt + completion as 4-byte integers: a list's elements are objects that
    # every full garbage collection visits (4,096 remembered turns of a long conversation were most
    # of the objects a collection of the agent workload walked), an array's are not
    raw_completion: str  # the completion's text as the model wrote it (tool calls unparsed)
    num_prompt_tokens: int
    prompt_text: str | None  # the rendered prompt that `ids[:num_prompt_tokens]` encode, when known
    text: str | None = None  # prompt + completion as text, special tokens included; made when first looked up

    def full_text(self, tokenizer: Any) -> str:
        """The prompt's rendered text and the completion decoded (special tokens kept); the whole decoded
        when the prompt's text is unknown. Decoding only the completion: a turn of a long conversation
        decoded whole took 3-6 ms of the server's thread per request (5,000 ids, 2-core CPU)."""
        if self.text is None:  # two threads may both make it: the same text
            if self.prompt_text is None:
                self.text = tokenizer.decode(self.ids.tolist(), skip_special_tokens=False)
            else:
                completion = self.ids[self.num_prompt_tokens:].tolist()
                self.text = self.prompt_text + tokenizer.decode(completion, skip_special_tokens=False)
        return self.text


class TurnCache:
    """Recent completions, looked up by what the client sends back for them.

    Args:
        tokenizer: decodes ids to the template's text (special tokens kept).
        capacity: how many completions to remember (least recently used ones are forgotten).
        text_capacity: how many tokenized pieces of texts to remember (their ids as 4-byte integers).
    """

    def __init__(self, tokenizer: Any, capacity: int = 4096, text_capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.text_capacity = text_capacity
        self._turns: collections.OrderedDict[tuple, list[_Turn]] = collections.OrderedDict()
        self._texts: collections.OrderedDict[str, array.array] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pieces = _piece_pattern(tokenizer)

    @staticmethod
    def key(content: str | None, call_ids: list[str]) -> tuple:
        """How an assistant message is recognized: by its tool-call ids, else by its content."""
        return ("calls", tuple(call_ids)) if call_ids else ("text", content or "")

    def remember(self, prompt_ids: list[int], completion_ids: list[int], raw_completion: str,
                 content: str | None, call_ids: list[str], *, prompt_text: str | None = None) -> None:
        """Remember a finished turn.

        Args:
            prompt_text: the rendered text `prompt_ids` encode (`ChatRenderer.render_prompt_and_text`);
                None: the ids are decoded when a later request first looks the turn up.
        """
        # the text is made when a later request first looks for it: most RL rollouts are one turn
        ids = array.array("i", prompt_ids)
        ids.extend(completion_ids)
        turn = _Turn(ids, raw_completion, len(prompt_ids), prompt_text)
        k = self.key(content, call_ids)
        with self._lock:
            self._turns.setdefault(k, []).append(turn)
            self._turns.move_to_end(k)
            while len(self._turns) > self.capacity:
                self._turns.popitem(last=False)

    def raw_text(self, call_ids: list[str]) -> str | None:
        """The model's own text of the assistant turn that produced these tool calls (if remembered)."""
        with self._lock:
            turns = self._turns.get(self.key(None, call_ids))
        return turns[-1].raw_completion if turns else None

    def encode(self, text: str, assistant_messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered `text`, reusing the exact ids of the latest remembered turn it extends.

        Args:
            text: the rendered prompt.
            assistant_messages: the conversation's assistant messages, in order.
        """
        for message in reversed(assistant_messages):
            call_ids = [c.get("id", "") for c in message.get("tool_calls") or []]
            with self._lock:
                turns = list(self._turns.get(self.key(message.get("content"), call_ids), ()))
            for turn in reversed(turns):
                turn_text = turn.full_text(self.tokenizer)
                if text.startswith(turn_text):
                    rest = text[len(turn_text):]
                    return turn.ids.tolist() + (self.tokenize(rest) if rest else [])
        return self.tokenize(text)

    def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids (no special tokens added), remembered for the next request that sends it:
        by piece, each starting at a special token (see the module's docstring)."""
        pieces = _split(text, self._pieces)
        found: list[array.array | None] = []
        with self._lock:
            for piece in pieces:
                ids = self._texts.get(piece)
                if ids is not None:
                    self._texts.move_to_end(piece)
                found.append(ids)
        missing = [p for p, ids in zip(pieces, found) if ids is None]
        if missing:
            encoded = self._encode(missing)
            with self._lock:
                for piece, ids in zip(missing, encoded):
                    self._texts[piece] = ids
                    self._texts.move_to_end(piece)
                while len(self._texts) > self.text_capacity:
                    self._texts.popitem(last=False)
            new = iter(encoded)
            found = [ids if ids is not None else next(new) for ids in found]
        if len(found) == 1:
            return found[0].tolist()
        out = array.array("i")
        for ids in found:
            out.extend(ids)
        return out.tolist()

    def _encode(self, texts: list[str]) -> list[array.array]:
        if len(texts) == 1:
            return [array.array("i", self.tokenizer(texts[0], add_special_tokens=False)["input_ids"])]
        return [array.array("i", ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _split(text: str, tokens: tuple[re.Pattern, frozenset[str]] | None) -> list[str]:
    """`text` cut before each special token that may start a piece (the whole text without one)."""
    if tokens is None:
        return [text]
    pattern, cut = tokens
    starts = [m.start() for m in pattern.finditer(text) if m.start() > 0 and m.group() in cut]
    if not starts:
        return [text]
    return [text[i:j] for i, j in zip([0, *starts], [*starts, len(text)])]


def _piece_pattern(tokenizer: Any) -> tuple[re.Pattern, frozenset[str]] | None:
    """(a pattern of the added tokens that the tokenizer matches on the raw text, those of them a text
    may be cut before), or None where cutting might change the ids.

    The pattern matches leftmost-longest, as `tokenizers` does (a trie: a tokenizer may have
    thousands of added tokens). A token that strips the whitespace
    before it (`lstrip`) takes that whitespace from the piece before: it is matched but not cut
    before. A token matched only as a whole word (`single_word`) depends on the character before
    it: then nothing is cut. The cut is also checked on a probe text around cut tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict) or not added or getattr(tokenizer, "split_special_tokens", False):
        return None
    raw = [t for t in added.values() if getattr(t, "normalized", True) is False and getattr(t, "content", "")]
    if any(getattr(t, "single_word", True) is not False for t in raw):
        return None
    cut = frozenset(t.content for t in raw if getattr(t, "lstrip", True) is False)
    if not cut:
        return None
    tokens = (re.compile(_trie({t.content for t in raw})), cut)
    # the first 32 by id (a chat template's markers are among them; Gemma's tokenizer has ~6,000 added tokens)
    probed = [t.content for _, t in sorted(added.items()) if t.content in cut][:32]
    probe = "Hi" + "".join(f"{c}{after}" for c in probed for after in ("user\n a  b\n", "\n", " c ", ""))
    try:
        whole = tokenizer(probe, add_special_tokens=False)["input_ids"]
        pieces = tokenizer(_split(probe, tokens), add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer that takes no batch
        return None
    return tokens if [i for ids in pieces for i in ids] == list(whole) else None


def _trie(words: set[str]) -> str:
    """A regex of `words` that matches the longest of them at a position, in time that does not grow
    with their number (a trie of their characters, each branch greedy)."""
    root: dict = {}
    for word in words:
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def branch(node: dict) -> str:
        alternatives = [re.escape(char) + branch(child) for char, child in sorted(node.items()) if char]
        if not alternatives:
            return ""
        inner = alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
        return f"(?:{inner})?" if "" in node else inner  # greedy: a longer word first, then the one ending here

    return branch(root)
