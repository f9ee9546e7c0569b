"""Messages (+ tools) → prompt token ids through the model's chat template.

The engine renders every request here, and the trainer renders here only when a choice does not
carry the prompt ids it was sampled with, so both sides produce the same ids.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChatRenderer"]


class ChatRenderer:
    """Renders conversations with a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a `transformers` tokenizer that has a `chat_template`.
        stop_token_ids: ids that end an assistant turn besides the tokenizer's EOS (for example
            the `eos_token_id` list of the model's generation config).

    Raises:
        ValueError: if the tokenizer has no chat template (a base, not an instruct, model).
    """

    def __init__(self, tokenizer: Any, stop_token_ids: list[int] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "use an instruct/chat model, or set tokenizer.chat_template before registering it"
            )
        self.tokenizer = tokenizer
        ids = {tokenizer.eos_token_id, *(stop_token_ids or [])}
        ids.discard(None)
        self.stop_token_ids: list[int] = sorted(ids)

    def render_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` followed by the template's assistant header (generation prompt).

        Returns:
            list[int] of length T (the prompt), with any BOS the template adds.
        """
        return self._ids(messages, tools, add_generation_prompt=True)

    def render_conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the whole conversation, without a generation prompt."""
        return self._ids(messages, tools, add_generation_prompt=False)

    def _ids(self, messages, tools, *, add_generation_prompt: bool) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": True}
        if tools:
            kwargs["tools"] = tools
        out = self.tokenizer.apply_chat_template([_plain(m) for m in messages], **kwargs)
        if hasattr(out, "keys"):  # transformers >= 5 returns a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message with `content: None` replaced by "" (templates concatenate strings)."""
    if message.get("content") is None:
        return {**message, "content": ""}
    return message
