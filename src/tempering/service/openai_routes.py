"""OpenAI-compatible inference routes: /v1/models, /v1/chat/completions, /v1/completions.

Besides the OpenAI fields, every choice carries what training needs:
- `token_ids`: the sampled ids, including the final stop token (e.g. `<|im_end|>`) when the
  sample ended on one;
- `prompt_token_ids`: the exact prompt ids the sample was generated from;
- `sampled_logprobs`: always returned, one float per sampled token: the logprob of `token_ids[i]`.
  OpenAI's `logprobs` object (one entry per token with its text, bytes and top alternatives) is
  returned only when the request asks for it (`logprobs=true`), as OpenAI and vLLM do: for a
  1024-token choice it is ~90 KB more to serialize and ~6 ms more for the openai client to
  parse, work that ran on the engine's process while the GPU waited (benchmarks/rl_loop.py);
- `logprob_temperature`: the temperature those logprobs were computed at, `log_softmax(logits / T)`,
  before top-k/top-p truncation (T = 1 for greedy requests);
- `policy_versions`: per sampled token, the policy version (training step) of the weights that
  sampled it; a sample of `model.name` that spans a training step has two.

With `tools`, the model's `<tool_call>{...}</tool_call>` text becomes OpenAI `tool_calls` with
`finish_reason="tool_calls"` (a malformed call stays plain content). `tool_choice` "auto"
(default), "none", "required" or a named function; the last two start the assistant turn with a
call (that forced text is part of `prompt_token_ids`, not of the sampled `token_ids`).
`stream=true` sends server-sent events (chat_stream.py).

Structured outputs (service/structured.py): `response_format`, vLLM's `guided_*` and
`structured_outputs`, and "required"/named tool calls constrain sampling with a grammar. Such a
choice also carries `grammar_forced`: per sampled token, whether the grammar allowed only that
token (training can leave those out of the loss). `/v1/models` lists `structured_outputs: true`
when the server can constrain (llguidance is installed); without it, constrained requests get a
400 naming the extra, and "required"/named tool calls are started but not held to the schema.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat.tools import TOOL_CALL_END, forced_prefix, parse_tool_calls
from ..engine import Completion, SamplingParams
from ..engine.grammar import CompiledGrammar, GrammarSpec, llguidance_installed
from ..errors import ConfigError
from .chat_stream import StreamState, sse_chat_stream
from .registry import ServiceRegistry
from .schemas import ChatCompletionRequest, CompletionRequest
from .structured import request_spec, tool_call_spec

__all__ = ["build_openai_router"]


def build_openai_router(registry: ServiceRegistry) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        created = int(time.time())
        structured = llguidance_installed()
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": "tempering", "structured_outputs": structured}
                     for n in registry.served_names()],
        }

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        _reject_unsupported(body)
        service, step = registry.resolve(body.model)
        if step is not None:  # a saved step's adapter may have to be loaded: not on the event loop
            await asyncio.to_thread(service.policy, step)
        prompt_tools = _checked_tools(body)  # rendered even with tool_choice "none": the prompt stays stable
        tools = prompt_tools if body.tool_choice != "none" else None  # tools the model may call now
        prefix = forced_prefix(body.tool_choice) if tools else None
        allowed = {t["function"]["name"] for t in tools} if tools else None
        spec = request_spec(body)
        # without the grammar library a forced call is only started (the prefix), not held to the schema
        call_spec = tool_call_spec(tools, body.tool_choice) if tools and llguidance_installed() else None
        if spec is not None and call_spec is not None:
            raise ConfigError("tool_choice forces a tool call, whose arguments follow the tool's schema; "
                              "drop response_format/guided_*/structured_outputs, or use tool_choice 'auto'")
        grammar = await _compiled(service, spec or call_spec)
        prompt_ids = service.renderer.render_prompt(body.messages, prompt_tools, tool_choice=body.tool_choice, turns=service.turns)
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_top = (body.top_logprobs or 0) if body.logprobs else 0
        params = _params(body, max_tokens, service.max_seq_len - len(prompt_ids), num_top, grammar)
        if tools and TOOL_CALL_END not in params.stop:
            params.stop = [*params.stop, TOOL_CALL_END]  # a call ends the turn; the engine hands back control
        decode = _token_decoder(service.tokenizer)

        def finish(c: Completion) -> dict[str, Any]:
            """The choice's message and finish reason; remembers the turn's exact ids."""
            content, calls = parse_tool_calls((prefix or "") + c.text, allowed=allowed) if tools else (c.text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            # the model's own text of the turn (stop string included): how a later request renders it back
            raw = (prefix or "") + service.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            service.turns.remember(prompt_ids, c.token_ids, raw, content, [call.id for call in calls])
            return {"message": message, "finish_reason": "tool_calls" if calls else c.finish_reason, **_forced(c)}

        if body.stream:
            states = [StreamState(lambda ids: service.tokenizer.decode(ids, skip_special_tokens=True), prefix=prefix,
                                  tools_on=bool(tools), stop=params.stop) for _ in range(body.n)]
            events = sse_chat_stream(
                submit=lambda on_token: service.submit(prompt_ids, params, n=body.n, step=step, on_token=on_token),
                model=body.model, prompt_ids=prompt_ids, n=body.n, states=states,
                token_entry=(lambda t, lp, top: _logprob_entry(decode, t, lp, top, num_top)) if body.logprobs else None,
                finish=lambda i, c: finish(c), include_usage=bool((body.stream_options or {}).get("include_usage")),
            )
            return StreamingResponse(events, media_type="text/event-stream")

        completions = await asyncio.wrap_future(service.submit(prompt_ids, params, n=body.n, step=step))
        choices = []
        for i, c in enumerate(completions):
            choice = {"index": i, **finish(c)}
            choice.update({
                "logprobs": {"content": [_chat_logprob(decode, c, t, num_top) for t in range(len(c.token_ids))]}
                if body.logprobs else None,
                "token_ids": c.token_ids,
                "sampled_logprobs": c.logprobs,
                "prompt_token_ids": prompt_ids,
                "logprob_temperature": c.logprob_temperature,
                "policy_versions": c.policy_versions,
            })
            choices.append(choice)
        return _response("chat.completion", body.model, choices, len(prompt_ids), completions)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest) -> JSONResponse:
        _reject_unsupported(body)
        service, step = registry.resolve(body.model)
        if step is not None:
            await asyncio.to_thread(service.policy, step)
        if isinstance(body.prompt, str):
            prompt_ids = service.tokenizer(body.prompt, add_special_tokens=True)["input_ids"]
        else:
            prompt_ids = list(body.prompt)
            vocab = len(service.tokenizer)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise HTTPException(400, f"prompt token ids must be in [0, {vocab})")
        num_top = body.logprobs or 0
        grammar = await _compiled(service, request_spec(body))
        params = _params(body, body.max_tokens or 16, service.max_seq_len - len(prompt_ids), num_top, grammar)
        results = await asyncio.wrap_future(service.submit(prompt_ids, params, n=body.n, step=step))
        decode = _token_decoder(service.tokenizer)
        choices = []
        for i, c in enumerate(results):
            choices.append({
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": _completion_logprobs(decode, c, num_top) if body.logprobs is not None else None,
                "token_ids": c.token_ids,
                "sampled_logprobs": c.logprobs,
                "prompt_token_ids": prompt_ids,
                "logprob_temperature": c.logprob_temperature,
                **_forced(c),
                "policy_versions": c.policy_versions,
            })
        return _response("text_completion", body.model, choices, len(prompt_ids), results)

    return router


def _checked_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools, checked, and tool_choice checked against them."""
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none", "required") and not (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    ):
        raise HTTPException(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')
    if not body.tools:
        if isinstance(choice, dict) or choice == "required":
            raise HTTPException(400, f"tool_choice {choice!r} needs a non-empty `tools` list")
        return None
    names = set()
    for i, tool in enumerate(body.tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise HTTPException(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        names.add(fn["name"])
    if isinstance(choice, dict) and choice["function"].get("name") not in names:
        raise HTTPException(400, f"tool_choice names {choice['function'].get('name')!r}, which is not in tools {sorted(names)}")
    return body.tools


def _reject_unsupported(body: Any) -> None:
    if isinstance(body, CompletionRequest) and body.stream:
        raise HTTPException(400, "stream=true is supported on /v1/chat/completions only; send stream=false")
    if body.presence_penalty or body.frequency_penalty:
        raise HTTPException(400, "presence_penalty and frequency_penalty are not supported; leave them at 0")


async def _compiled(service: Any, spec: GrammarSpec | None) -> CompiledGrammar | None:
    """The compiled grammar of `spec` (off the event loop: the first one builds the tokenizer's trie).

    Raises:
        ConfigError: if the spec does not compile (HTTP 400); MissingDependencyError without llguidance.
    """
    if spec is None:
        return None
    return await asyncio.to_thread(service.grammars.compile, spec)


def _forced(c: Completion) -> dict[str, Any]:
    """`grammar_forced` of a constrained choice (per sampled token: the grammar allowed only it)."""
    return {"grammar_forced": c.forced} if c.forced is not None else {}


def _params(body: Any, max_tokens: int | None, room: int, num_top: int, grammar: CompiledGrammar | None = None) -> SamplingParams:
    if room < 1:
        raise HTTPException(400, "the prompt fills the model's whole context; shorten it")
    return SamplingParams(
        max_tokens=min(max_tokens or room, room),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        num_top_logprobs=num_top,
        grammar=grammar,
    )


def _token_decoder(tokenizer: Any):
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id])
        return text

    return decode


def _logprob_entry(decode, token_id: int, logprob: float, top: list[tuple[int, float]], num_top: int) -> dict[str, Any]:
    text = decode(token_id)
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": decode(a), "logprob": lp, "bytes": list(decode(a).encode("utf-8"))} for a, lp in top
        ] if num_top else [],
    }


def _completion_logprobs(decode, c: Completion, num_top: int) -> dict[str, Any]:
    """The legacy completions API's `logprobs` object of one choice."""
    tokens = [decode(t) for t in c.token_ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": c.logprobs,
        "top_logprobs": [{decode(a): lp for a, lp in top} for top in c.top_logprobs] if num_top else None,
        "text_offset": offsets,
    }


def _chat_logprob(decode, c: Completion, t: int, num_top: int) -> dict[str, Any]:
    return _logprob_entry(decode, c.token_ids[t], c.logprobs[t], c.top_logprobs[t], num_top)


def _response(kind: str, model: str, choices: list[dict], num_prompt: int, results: list[Completion]) -> JSONResponse:
    """The response, serialized here with `json.dumps`: handing FastAPI the dict would walk it through
    `jsonable_encoder` first, ~25 ms of the GIL for one 1024-token choice with logprobs (the engine's
    thread waits for the GIL meanwhile), against ~3 ms for the dump alone."""
    num_completion = sum(len(c.token_ids) for c in results)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return JSONResponse({
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion},
    })
