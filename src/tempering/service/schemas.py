"""Request bodies of the OpenAI-compatible routes, validated with size limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..types import LoRAConfig, TrainConfig, TrainSFTConfig, Trajectory, TrajectoryGroup

__all__ = [
    "ChatCompletionRequest",
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


class _SamplingFields(BaseModel):
    # Unknown fields are ignored, as vLLM does; OpenAI SDKs send only known ones.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=300)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="extension: 0 or -1 = off")
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=256)
    tool_choice: Any = None
    stream_options: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}] has role {m.get('role')!r}; use system, user, assistant or tool")
            if m.get("role") == "developer":  # OpenAI's newer name for system
                m = messages[i] = {**m, "role": "system"}
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(texts) != len(content):
                    raise ValueError(f"messages[{i}] has non-text content parts; only text is supported")
                messages[i] = {**m, "content": "".join(texts)}
            elif content is not None and not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        return messages


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(max_length=1_000_000)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Strict):
    name: str = Field(min_length=1, max_length=128)
    project: str = Field(min_length=1, max_length=128)
    base_model: str | None = Field(default=None, max_length=1000, description="given for a trainable model")
    lora_config: LoRAConfig | None = None
    model_json: dict[str, Any] = Field(default_factory=dict, description="the client's model, stored as model.json")


class TrainRequest(_Strict):
    request_id: str = Field(min_length=8, max_length=128, description="the same id on a retry returns the same job")
    groups: list[TrajectoryGroup] = Field(max_length=100_000)
    config: TrainConfig = Field(default_factory=TrainConfig)


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
