"""ART's `OpenAIServerConfig` (`TrainableModel.register(backend, _openai_client_config=...)`).

ART starts its own vLLM OpenAI server from it; tempering's server takes its settings from the
backend, so `register` accepts these keys and names each one it ignores in an ArtOptionWarning.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from .engine import EngineArgs

__all__ = ["OpenAIServerConfig", "ServerArgs"]


class ServerArgs(TypedDict, total=False):
    """Options of vLLM's OpenAI-compatible server (host, port, API key, tool parser, ...), as ART passes them."""

    host: str | None
    port: int
    uvicorn_log_level: Literal["debug", "info", "warning", "error", "critical", "trace"]
    api_key: str | None
    lora_modules: list[str] | None
    chat_template: str | None
    response_role: str | None
    ssl_keyfile: str | None
    ssl_certfile: str | None
    root_path: str | None
    return_tokens_as_token_ids: bool
    disable_frontend_multiprocessing: bool
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    max_log_len: int | None
    enable_prompt_tokens_details: bool
    enable_reasoning: bool
    reasoning_parser: str | None


class OpenAIServerConfig(TypedDict, total=False):
    """ART's server configuration: the log file, the server's options and extra engine options."""

    log_file: str
    server_args: ServerArgs
    engine_args: EngineArgs
