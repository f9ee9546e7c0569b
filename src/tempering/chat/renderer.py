"""Messages (+ tools) → prompt token ids through the model's chat template.

The engine renders every request here, and the trainer renders here only when a choice does not
carry the prompt ids it was sampled with, so both sides produce the same ids.

Tools: a template that renders `tools` itself (Qwen2.5/3, Llama 3.1...) gets them; for one that
ignores them (SmolLM2's), the schemas go into the system prompt with Hermes-style instructions
(chat/tools.py). Assistant turns with `tool_calls` are rendered as the model's own text when the
TurnCache remembers it, else in the Hermes format.
"""

from __future__ import annotations

import json
from typing import Any

from .tools import forced_prefix, tool_call_text, tools_system_prompt
from .turns import TurnCache

__all__ = ["ChatRenderer"]

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_zq", "description": "x", "parameters": {"type": "object", "properties": {}}}}


class ChatRenderer:
    """Renders conversations with a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a `transformers` tokenizer that has a `chat_template`.
        stop_token_ids: ids that end an assistant turn besides the tokenizer's EOS (for example
            the `eos_token_id` list of the model's generation config).

    Attributes:
        stop_token_ids: sorted, the tokenizer's EOS among them.
        end_of_turn_id: the stop id the template closes an assistant turn with (ChatML's
            `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`): where a sample
            held to a grammar ends, so that the turn renders back as it was sampled. It can
            differ from the tokenizer's EOS (Gemma's `<eos>`; SmolLM2's `<|im_start|>` as
            transformers 5.17 converts its GGUF).

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
        probe = [{"role": "user", "content": "x"}]
        try:
            self.template_renders_tools = self._text(probe, [_PROBE_TOOL], True) != self._text(probe, None, True)
        except Exception:  # a template that rejects the tools argument
            self.template_renders_tools = False
        self.end_of_turn_id = self._end_of_turn_id(probe)

    def _end_of_turn_id(self, probe: list[dict[str, Any]]) -> int | None:
        """The first stop id after the assistant's content in a rendered [user, assistant] exchange
        (the tokenizer's EOS when the template shows none there, None without stop ids)."""
        eos = self.tokenizer.eos_token_id
        fallback = eos if eos is not None else (self.stop_token_ids[0] if self.stop_token_ids else None)
        try:
            prompt = self._encode(self._text(probe, None, True), [], None)
            ids = self._encode(self._text([*probe, {"role": "assistant", "content": "y"}], None, False), [], None)
        except Exception:  # a template that needs more than a plain exchange
            return fallback
        turn = ids[len(prompt):] if ids[:len(prompt)] == prompt else ids  # the turn itself where the prompt leads
        return next((t for t in turn if t in self.stop_token_ids), fallback)

    def render_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        tool_choice: Any = None,
        turns: TurnCache | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of `messages` followed by the assistant header (and a forced tool-call start).

        Args:
            tool_choice: "required" or a named function starts the assistant turn with a tool
                call (chat/tools.py `forced_prefix`). "none" still renders the tools (the
                conversation's prompt stays the same from turn to turn); the server just does not
                parse calls then.
            turns: exact ids of earlier sampled turns to reuse.
            template_kwargs: extra variables of the chat template (e.g. Qwen3's `enable_thinking`).

        Returns:
            list[int] of length T (the prompt), with any BOS the template adds.
        """
        return self.render_prompt_and_text(messages, tools, tool_choice=tool_choice, turns=turns,
                                           template_kwargs=template_kwargs)[0]

    def render_prompt_and_text(self, messages, tools=None, *, tool_choice: Any = None, turns: TurnCache | None = None,
                               template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
        """(`render_prompt`'s ids, the rendered text they encode), for `TurnCache.remember`."""
        text = self.render_text(messages, tools, tool_choice=tool_choice, turns=turns, template_kwargs=template_kwargs)
        return self._encode(text, messages, turns), text

    def render_text(self, messages, tools=None, *, tool_choice: Any = None, turns: TurnCache | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt as text (see render_prompt)."""
        text = self._text(self.prepare(messages, tools, turns), tools if self.template_renders_tools else None, True,
                          template_kwargs)
        prefix = forced_prefix(tool_choice) if tools else None
        return text + (prefix or "")

    def render_conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the whole conversation, without a generation prompt."""
        text = self._text(self.prepare(messages, tools, None), tools if self.template_renders_tools else None, False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, turns: TurnCache | None) -> list[dict[str, Any]]:
        """Messages as the template should see them (tool calls as text where needed, tool schemas in the system prompt)."""
        out = []
        for m in messages:
            m = {**m, "content": m.get("content") if m.get("content") is not None else ""}
            calls = m.get("tool_calls") or []
            if m.get("role") == "assistant" and calls:
                raw = turns.raw_text([c.get("id", "") for c in calls]) if turns else None
                if raw is not None:
                    m = {"role": "assistant", "content": raw}
                elif not self.template_renders_tools:
                    text = "\n".join(tool_call_text(c["function"]["name"], c["function"].get("arguments", "{}")) for c in calls)
                    m = {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text}
                else:  # templates iterate over the arguments: give them objects
                    m["tool_calls"] = [_decoded(c) for c in calls]
            elif m.get("role") == "tool" and not self.template_renders_tools:
                m = {**m, "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            out.append(m)
        if tools and not self.template_renders_tools:
            instructions = tools_system_prompt(tools)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
            else:
                out.insert(0, {"role": "system", "content": instructions})
        return out

    def _encode(self, text: str, messages: list[dict[str, Any]], turns: TurnCache | None) -> list[int]:
        if turns is not None:
            return turns.encode(text, [m for m in messages if m.get("role") == "assistant"])
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _text(self, messages, tools, add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
        kwargs: dict[str, Any] = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt, "tokenize": False}
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def _decoded(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function", {}))
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}
