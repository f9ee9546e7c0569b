"""Request bodies of the OpenAI-compatible routes, validated with size limits."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator, model_validator

from ..types import LoRAConfig, TrainConfig, TrainSFTConfig, Trajectory, TrajectoryGroup

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CheckpointDeleteRequest",
    "CompletionRequest",
    "ForkRequest",
    "LogRequest",
    "RegisterRequest",
    "TrainRequest",
    "TrainSFTRequest",
]

MAX_MESSAGES = 4096
MAX_STOP = 16
# apply_chat_template's own arguments (and the template's `messages`): set by the server, not by chat_template_kwargs
_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class _SamplingFields(BaseModel):
    # Undeclared fields are kept in `model_extra`: the routes refuse those that would change results
    # (request_checks.reject_unsupported).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=300)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0, description="0 keeps only the most likely token")
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1, description="extension: 0 or -1 = off")
    n: int = Field(default=1, ge=1, le=128)
    stop: list[str] = Field(default_factory=list, description="a string or a list of strings")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP, description="extension")
    ignore_eos: bool = Field(default=False, description="extension: keep sampling past end-of-turn tokens")
    seed: int | None = Field(default=None, ge=0, le=2**62)
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # structured outputs (OpenAI and vLLM names), checked in service/structured.py so that a bad one is a 400
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    return_routed_experts: bool = Field(
        default=False, description="extension (vLLM, SGLang): a mixture of experts returns choice.routed_experts")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI takes null for an optional parameter (LangChain and LiteLLM send it): the default applies."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        if isinstance(part, dict) and part.get("type") != "text":
            raise ValueError(f"content parts of type {part.get('type')!r} are not supported; send text parts")
        return part


def _as_parts(content: Any) -> Any:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is not None and not isinstance(content, list):
        raise ValueError("content must be a string or a list of text parts")
    return content


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: Any = "{}"  # a JSON string (OpenAI); rendered as sent


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message; its other keys (name, tool_call_id, ...) reach the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[list[TextPart] | None, BeforeValidator(_as_parts)] = Field(
        default=None, description="a string or a list of text parts")
    tool_calls: list[AssistantToolCall] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: `developer` as `system` (OpenAI's newer name), text parts joined."""
        message = self.model_dump(exclude_unset=True)
        if self.role == "developer":
            message["role"] = "system"
        if self.content is not None:
            message["content"] = "".join(p.text for p in self.content)
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=256)
    tool_choice: Any = None
    # include_obfuscation: OpenAI's padding of stream chunks against side channels; nothing to pad here
    stream_options: dict[Literal["include_usage", "include_obfuscation"], StrictBool] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="extension (vLLM): variables of the chat template, e.g. {'enable_thinking': false} for Qwen3")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(kwargs.keys() & _TEMPLATE_ARGS)
        if taken:
            raise ValueError(f"{taken} cannot be set here: the server sets them")
        return kwargs


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(max_length=1_000_000)
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """A list of one prompt (a string or a token list; LangChain's OpenAI LLM always sends one)
        is that prompt.

        Raises:
            ValueError: a list of several prompts (a batch).
        """
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                raise ValueError("batched prompts are not supported; send one request per prompt")
            return prompt[0]
        return prompt


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Strict):
    name: str = Field(min_length=1, max_length=128)
    project: str = Field(min_length=1, max_length=128)
    base_model: str | None = Field(default=None, max_length=1000, description="given for a trainable model")
    lora_config: LoRAConfig | None = None
    model_json: dict[str, Any] = Field(default_factory=dict, description="the client's model, stored as model.json")
    dedicated_gpus: int | None = Field(default=None, ge=2, le=1024, description="dedicated mode on this many GPUs "
                                       "(GPU 0 trains, the others serve): ART's trainer_gpu_ids/inference_gpu_ids")


class TrainRequest(_Strict):
    request_id: str = Field(min_length=8, max_length=128, description="the same id on a retry returns the same job")
    groups: list[TrajectoryGroup] = Field(max_length=100_000)
    config: TrainConfig = Field(default_factory=TrainConfig)
    log: bool = Field(default=True, description="append the step's history row and write its trajectories "
                      "(model.train); ART's backend.train leaves that to the caller's model.log")


class TrainSFTRequest(_Strict):
    request_id: str = Field(min_length=8, max_length=128, description="the same id on a retry returns the same job")
    trajectories: list[Trajectory] = Field(max_length=1_000_000)
    config: TrainSFTConfig = Field(default_factory=TrainSFTConfig)


class LogRequest(_Strict):
    split: str = Field(default="val", min_length=1, max_length=64)
    step: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    groups: list[TrajectoryGroup] = Field(default_factory=list, max_length=100_000)


class CheckpointDeleteRequest(_Strict):
    keep_steps: list[int] = Field(default_factory=list, max_length=100_000)


class ForkRequest(_Strict):
    project: str = Field(min_length=1, max_length=128, description="project of the new (target) model")
    from_project: str = Field(min_length=1, max_length=128)
    from_model: str = Field(min_length=1, max_length=128)
    step: int | None = Field(default=None, ge=0)
    not_after_step: int | None = Field(default=None, ge=0, description="with step unset: the latest step at or before it")
