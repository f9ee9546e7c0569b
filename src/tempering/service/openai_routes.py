"""OpenAI-compatible inference routes: /v1/models, /v1/chat/completions, /v1/completions.

Besides the OpenAI fields, every choice carries what training needs:
- `token_ids`: the sampled ids, including the final stop token (e.g. `<|im_end|>`) when the
  sample ended on one;
- `prompt_token_ids`: the exact prompt ids the sample was generated from;
- `logprobs`: always returned (as if `logprobs=true`): `content[i].logprob` is the logprob of
  `token_ids[i]`;
- `logprob_temperature`: the temperature those logprobs were computed at, `log_softmax(logits / T)`,
  before top-k/top-p truncation (T = 1 for greedy requests).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException

from ..engine import Completion, SamplingParams
from .registry import ServiceRegistry
from .schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["build_openai_router"]


def build_openai_router(registry: ServiceRegistry) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        created = int(time.time())
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": "tempering"} for n in registry.served_names()],
        }

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> dict[str, Any]:
        _reject_unsupported(body)
        service, step = registry.resolve(body.model)
        prompt_ids = service.renderer.render_prompt(body.messages, body.tools)
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_top = (body.top_logprobs or 0) if body.logprobs else 0
        params = _params(body, max_tokens, service.max_seq_len - len(prompt_ids), num_top)
        completions = await asyncio.wrap_future(service.submit(prompt_ids, params, n=body.n, step=step))
        decode = _token_decoder(service.tokenizer)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": {"content": [_chat_logprob(decode, c, t, num_top) for t in range(len(c.token_ids))]},
                "token_ids": c.token_ids,
                "prompt_token_ids": prompt_ids,
                "logprob_temperature": c.logprob_temperature,
            }
            for i, c in enumerate(completions)
        ]
        return _response("chat.completion", body.model, choices, len(prompt_ids), completions)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        _reject_unsupported(body)
        service, step = registry.resolve(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = service.tokenizer(body.prompt, add_special_tokens=True)["input_ids"]
        else:
            prompt_ids = list(body.prompt)
            vocab = len(service.tokenizer)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise HTTPException(400, f"prompt token ids must be in [0, {vocab})")
        num_top = body.logprobs or 0
        params = _params(body, body.max_tokens or 16, service.max_seq_len - len(prompt_ids), num_top)
        results = await asyncio.wrap_future(service.submit(prompt_ids, params, n=body.n, step=step))
        decode = _token_decoder(service.tokenizer)
        choices = []
        for i, c in enumerate(results):
            tokens = [decode(t) for t in c.token_ids]
            offsets, pos = [], 0
            for tok in tokens:
                offsets.append(pos)
                pos += len(tok)
            choices.append({
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": {
                    "tokens": tokens,
                    "token_logprobs": c.logprobs,
                    "top_logprobs": [{decode(a): lp for a, lp in top} for top in c.top_logprobs] if num_top else None,
                    "text_offset": offsets,
                },
                "token_ids": c.token_ids,
                "prompt_token_ids": prompt_ids,
                "logprob_temperature": c.logprob_temperature,
            })
        return _response("text_completion", body.model, choices, len(prompt_ids), results)

    return router


def _reject_unsupported(body: Any) -> None:
    if body.stream:
        raise HTTPException(400, "stream=true is not supported yet; send stream=false")
    if body.presence_penalty or body.frequency_penalty:
        raise HTTPException(400, "presence_penalty and frequency_penalty are not supported; leave them at 0")


def _params(body: Any, max_tokens: int | None, room: int, num_top: int) -> SamplingParams:
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
    )


def _token_decoder(tokenizer: Any):
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id])
        return text

    return decode


def _chat_logprob(decode, c: Completion, t: int, num_top: int) -> dict[str, Any]:
    text = decode(c.token_ids[t])
    return {
        "token": text,
        "logprob": c.logprobs[t],
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": decode(a), "logprob": lp, "bytes": list(decode(a).encode("utf-8"))} for a, lp in c.top_logprobs[t]
        ] if num_top else [],
    }


def _response(kind: str, model: str, choices: list[dict], num_prompt: int, results: list[Completion]) -> dict[str, Any]:
    num_completion = sum(len(c.token_ids) for c in results)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion},
    }
