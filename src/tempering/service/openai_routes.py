"""OpenAI-compatible inference routes: /v1/models, /v1/chat/completions, /v1/completions.

Besides the OpenAI fields, every choice carries what training needs:
- `token_ids`: the sampled ids, including the final stop token (e.g. `<|im_end|>`) when the
  sample ended on one;
- `prompt_token_ids`: the exact prompt ids the sample was generated from;
- `sampled_logprobs`: always returned, one float per sampled token: the logprob of `token_ids[i]`.
  OpenAI's `logprobs` object (one entry per token with its text, bytes and top alternatives) is
  returned only when the request asks for it (`logprobs=true`), as OpenAI and vLLM do; on chat
  completions its `content` covers the tokens of the returned content only, as OpenAI's does (not
  the stop token, tokens sampled past a stop string, or a tool call's tokens): for a
  1024-token choice it is ~90 KB more to serialize and ~6 ms more for the openai client to
  parse, work that ran on the engine's process while the GPU waited (benchmarks/rl_loop.py);
- `logprob_temperature`: the temperature those logprobs were computed at, `log_softmax(logits / T)`,
  before top-k/top-p truncation (T = 1 for greedy requests);
- `policy_versions`: per sampled token, the policy version (training step) of the weights that
  sampled it; a sample of `model.name` that spans a training step has two.
- `routed_experts` (a mixture of experts, only when asked for: `return_routed_experts=true` in the
  body, as vLLM and SGLang name it, or the header `X-Return-Routed-Experts: true`, which
  `model.openai_client()` sends): the experts each token of prompt + completion but the last was
  routed to in each MoE layer, base64 of a [tokens - 1, layers, k] array
  (modeling/routing_format.py); training replays them (`TrainConfig.moe_routing_replay`).

With `tools`, the model's `<tool_call>{...}</tool_call>` text becomes OpenAI `tool_calls` with
`finish_reason="tool_calls"` (a malformed call, or one cut by max_tokens, stays plain content; the
latter with `finish_reason="length"`: `_chat_choice`). `tool_choice` "auto"
(default), "none", "required" or a named function; the last two start the assistant turn with a
call (that forced text is part of `prompt_token_ids`, not of the sampled `token_ids`).
`stream=true` sends server-sent events (chat_stream.py).

A field tempering does not implement gets a 400 naming it whenever it would change the results
(`logit_bias`, `min_p`, ...: request_checks.py), as does a field OpenAI does not define.

Structured outputs (service/structured.py): `response_format`, vLLM's `guided_*` and
`structured_outputs`, and "required"/named tool calls constrain sampling with a grammar. Such a
choice also carries `grammar_forced`: per sampled token, whether the grammar allowed only that
token (training can leave those out of the loss). `/v1/models` lists `structured_outputs: true`
when the server can constrain (llguidance, a dependency, is installed); without it (a broken
install), constrained requests get a 400 naming the package, and "required"/named tool calls are
started but not held to the schema.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from pydantic_core import to_json

from ..chat.tools import TOOL_CALL_END, forced_prefix, parse_tool_calls
from ..engine import Completion, SamplingParams
from ..engine.grammar import CompiledGrammar, GrammarSpec, llguidance_installed
from ..errors import ConfigError, UnknownModelError
from ..modeling.routing_format import encode_routed_experts
from .chat_stream import StreamState, num_content_tokens, sse_chat_stream, start_stream, usage
from .logprob_fields import chat_logprob, completion_logprobs, logprob_entry, token_decoder
from .registry import ServiceRegistry
from .request_checks import check_tokens, checked_tools, reject_unsupported, valid_unicode
from .schemas import ChatCompletionRequest, CompletionRequest
from .structured import compile_checked, request_spec, tool_call_spec

__all__ = ["build_model_lookup_router", "build_openai_router"]


async def _generated(request: Request, service: Any, future: Any) -> Any:
    """The result of a generation's concurrent Future, stopping the generation if the client
    disconnects first (as vLLM does): a client that timed out, and the copy its SDK retries, do
    not leave orphaned samples on the engine."""
    result = asyncio.wrap_future(future)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not future.done():  # the client left (or this handler was cancelled)
            service.abort(future)
            # nobody awaits it now: take its RequestAborted so asyncio does not print "Future exception
            # was never retrieved ... RequestAborted" to the user, who only stopped waiting
            result.add_done_callback(lambda f: f.cancelled() or f.exception())
    if not result.done():
        raise HTTPException(499, "the client closed the connection; the generation was stopped")
    return result.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "tempering",
            "structured_outputs": llguidance_installed()}


def build_model_lookup_router(registry: ServiceRegistry) -> APIRouter:
    """GET /v1/models/{id} (`client.models.retrieve(id)`). A served name may hold "/" (a base model's
    hub id, "HuggingFaceTB/SmolLM2-135M-Instruct"), so the id is the rest of the path: include this
    router after the training routes, whose /v1/models/{name}/step, /history, ... come first."""
    router = APIRouter(dependencies=[Depends(valid_unicode)])

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        """One served name; 404 naming the valid ones otherwise."""
        names = registry.served_names()
        if model_id not in names:
            raise UnknownModelError(f"model {model_id!r} does not exist; valid names: {names}")
        return _model_object(model_id, int(time.time()))

    return router


def build_openai_router(registry: ServiceRegistry) -> APIRouter:
    router = APIRouter(dependencies=[Depends(valid_unicode)])

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [_model_object(n, created) for n in registry.served_names()]}

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        reject_unsupported(body)
        service, step = registry.resolve(body.model)
        if step is not None:  # a saved step's adapter may have to be loaded: not on the event loop
            await asyncio.to_thread(service.prepare_step, step)
        prompt_tools = checked_tools(body)  # rendered even with tool_choice "none": the prompt stays stable
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
        prompt_ids, prompt_text = service.renderer.render_prompt_and_text(
            [m.template_dict() for m in body.messages], prompt_tools, tool_choice=body.tool_choice,
            turns=service.turns, template_kwargs=body.chat_template_kwargs)
        check_tokens(service, body, prompt_ids)
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_top = (body.top_logprobs or 0) if body.logprobs else 0
        params = _params(body, max_tokens, service.max_seq_len - len(prompt_ids), num_top, grammar,
                         tools_on=bool(tools))
        params.return_routed_experts = _wants_routing(body, request)
        decode = token_decoder(service.tokenizer)

        def decode_text(ids: list[int]) -> str:
            return service.tokenizer.decode(ids, skip_special_tokens=True)

        def finish(c: Completion) -> dict[str, Any]:
            """The choice's message and finish reason; remembers the turn's exact ids."""
            final = _chat_choice(c, prefix=prefix, tool_names=allowed)
            message = final["message"]
            # the model's own text of the turn (stop string included): how a later request renders it back
            raw = (prefix or "") + (c.text if c.raw_text is None else c.raw_text)
            service.turns.remember(prompt_ids, c.token_ids, raw, message["content"],
                                   [call["id"] for call in message.get("tool_calls", ())], prompt_text=prompt_text)
            return {**final, **_forced(c), **_routed(c)}

        if body.stream:
            states = [StreamState(decode_text, prefix=prefix, tools_on=bool(tools), stop=params.stop) for _ in range(body.n)]
            started = start_stream(
                lambda on_token: service.submit(prompt_ids, params, n=body.n, step=step, on_token=on_token))
            events = sse_chat_stream(
                started=started, abort=service.abort,
                model=body.model, prompt_ids=prompt_ids, n=body.n, states=states,
                token_entry=(lambda t, lp, top: logprob_entry(decode, t, lp, top, num_top)) if body.logprobs else None,
                finish=lambda i, c: finish(c), include_usage=bool((body.stream_options or {}).get("include_usage")),
            )
            return StreamingResponse(events, media_type="text/event-stream")

        completions = await _generated(request, service, service.submit(prompt_ids, params, n=body.n, step=step))
        choices = []
        for i, c in enumerate(completions):
            choice = {"index": i, **finish(c)}
            num_entries = num_content_tokens(decode_text, c.token_ids, prefix, choice["message"]["content"]) \
                if body.logprobs else 0
            choice.update({
                "logprobs": {"content": [chat_logprob(decode, c, t, num_top) for t in range(num_entries)]}
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
    async def completions(body: CompletionRequest, request: Request) -> Response:
        reject_unsupported(body)
        service, step = registry.resolve(body.model)
        if step is not None:
            await asyncio.to_thread(service.prepare_step, step)
        if isinstance(body.prompt, str):
            prompt_ids = service.tokenizer(body.prompt, add_special_tokens=True)["input_ids"]
        else:
            prompt_ids = list(body.prompt)
        check_tokens(service, body, prompt_ids)
        num_top = body.logprobs or 0
        grammar = await _compiled(service, request_spec(body))
        params = _params(body, body.max_tokens or 16, service.max_seq_len - len(prompt_ids), num_top, grammar)
        params.return_routed_experts = _wants_routing(body, request)
        results = await _generated(request, service, service.submit(prompt_ids, params, n=body.n, step=step))
        decode = token_decoder(service.tokenizer)
        choices = []
        for i, c in enumerate(results):
            choices.append({
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": completion_logprobs(decode, c, num_top) if body.logprobs is not None else None,
                "token_ids": c.token_ids,
                "sampled_logprobs": c.logprobs,
                "prompt_token_ids": prompt_ids,
                "logprob_temperature": c.logprob_temperature,
                **_forced(c),
                "policy_versions": c.policy_versions,
                **_routed(c),
            })
        return _response("text_completion", body.model, choices, len(prompt_ids), results)

    return router


async def _compiled(service: Any, spec: GrammarSpec | None) -> CompiledGrammar | None:
    """The compiled grammar of `spec` (off the event loop: the first one builds the tokenizer's trie).

    Raises:
        ConfigError: if the spec does not compile (HTTP 400); MissingDependencyError without llguidance.
    """
    if spec is None:
        return None
    return await asyncio.to_thread(compile_checked, service.grammars, spec)


def _chat_choice(c: Completion, *, prefix: str | None, tool_names: set[str] | None) -> dict[str, Any]:
    """A chat choice's {"message": ..., "finish_reason": ...}, streamed or not.

    Args:
        c: the finished sample.
        prefix: the text the turn was forced to start with (a tool call's opening), or None.
        tool_names: the tools the model may call now; None when it may call none (no call is parsed).

    The engine ends a call at its `</tool_call>` (a stop string, cut from `c.text`), so a call's
    closing tag is missing from every text; what tells a finished call from a cut one is the finish
    reason. A sample that ran out of max_tokens ("length") holds no finished call, even where its
    JSON happens to be whole: its closing tag and end of turn were never sampled. It keeps
    finish_reason "length" (OpenAI's meaning: max_tokens ran out) and its text, forced prefix
    included, stays plain content with no `tool_calls`, as a malformed call does: an agent loop or
    RL rollout never runs a truncated call as if the model had finished it.
    """
    if tool_names is None:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    text = (prefix or "") + c.text
    content, calls = parse_tool_calls(text, allowed=tool_names) if c.finish_reason != "length" else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    return {"message": message, "finish_reason": "tool_calls" if calls else c.finish_reason}


def _forced(c: Completion) -> dict[str, Any]:
    """`grammar_forced` of a constrained choice (per sampled token: the grammar allowed only it)."""
    return {"grammar_forced": c.forced} if c.forced is not None else {}


def _routed(c: Completion) -> dict[str, Any]:
    """`routed_experts` of a mixture-of-experts sample whose request asked for them."""
    return {"routed_experts": encode_routed_experts(c.routed_experts)} if c.routed_experts is not None else {}


ROUTED_EXPERTS_HEADER = "x-return-routed-experts"


def _wants_routing(body: Any, request: Request) -> bool:
    """Whether the request asks for `routed_experts` (body field, or the tempering client's header)."""
    return body.return_routed_experts or request.headers.get(ROUTED_EXPERTS_HEADER, "").lower() in ("1", "true")


def _params(body: Any, max_tokens: int | None, room: int, num_top: int, grammar: CompiledGrammar | None = None,
            *, tools_on: bool = False) -> SamplingParams:
    """The engine's SamplingParams of a chat or completion request.

    With tools the model may call (`tools_on`), `</tool_call>` is a stop string: a call ends the
    turn and the engine hands back control.

    A guided choice (`guided_choice`, `structured_outputs.choice`) ignores the request's stop
    strings and stop token ids: its grammar already ends the sample after a whole choice, and a
    stop inside the chosen option ("stop" in "nonstop", or one of its tokens) would cut it, so that
    the content would be none of the choices. vLLM applies them regardless; here the whole choice
    is returned, and `</tool_call>` is not added (the grammar allows no call). Other constraints
    (JSON, regex, grammar) keep them.
    """
    is_choice = grammar is not None and grammar.spec.kind == "choice"
    stop = [] if is_choice else list(body.stop)
    if tools_on and not is_choice and TOOL_CALL_END not in stop:
        stop.append(TOOL_CALL_END)
    return SamplingParams(
        max_tokens=min(max_tokens or room, room),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=stop,
        stop_token_ids=[] if is_choice else body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        num_top_logprobs=num_top,
        grammar=grammar,
    )


def _response(kind: str, model: str, choices: list[dict], num_prompt: int, results: list[Completion]) -> Response:
    """The response, serialized here (`json_body`): handing FastAPI the dict would walk it through
    `jsonable_encoder` first, ~25 ms of the GIL for one 1024-token choice with logprobs (the engine's
    thread waits for the GIL meanwhile)."""
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return Response(json_body({
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(num_prompt, results),
    }), media_type="application/json")


def json_body(content: Any) -> bytes:
    """`content` as compact JSON bytes, as Starlette's JSONResponse writes it, in about a seventh of
    the time: pydantic-core's serializer (Rust) takes 0.23 ms for a 1,024-token choice where
    `json.dumps` takes 1.6 ms (2-core CPU). A non-finite float is refused (ValueError), as
    `json.dumps(allow_nan=False)` refuses it: when the fast output may hold one, `json.dumps`
    decides."""
    out = to_json(content)
    if b"NaN" in out or b"Infinity" in out:  # a non-finite float, or only text that contains these words
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return out
