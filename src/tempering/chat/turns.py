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
"""

from __future__ import annotations

import array
import collections
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
        text_capacity: how many tokenized texts to remember (their ids as 4-byte integers).
    """

    def __init__(self, tokenizer: Any, capacity: int = 4096, text_capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.text_capacity = text_capacity
        self._turns: collections.OrderedDict[tuple, list[_Turn]] = collections.OrderedDict()
        self._texts: collections.OrderedDict[str, array.array] = collections.OrderedDict()
        self._lock = threading.Lock()

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
        """`text`'s token ids (no special tokens added), remembered for the next request that sends it."""
        with self._lock:
            ids = self._texts.get(text)
            if ids is not None:
                self._texts.move_to_end(text)
                return ids.tolist()
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        with self._lock:
            self._texts[text] = array.array("i", ids)
            while len(self._texts) > self.text_capacity:
                self._texts.popitem(last=False)
        return ids
