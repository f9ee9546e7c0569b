"""A batched generation engine on a `transformers` causal LM with its KV cache.

Requests from concurrent rollouts queue up; a worker thread takes those that share a policy
(adapter), pads them on the left into one batch, prefills it, and decodes token by token with
a `DynamicCache`, dropping finished rows from the cache as it goes. Sampling and logprobs are
ours (`sampler.py`), so every sampled token comes back with its logprob.

Requests that arrive while a batch runs wait for the next batch (static batching); the engine
holds `lock` for a whole batch so that a training step never changes the weights mid-sample.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import EngineError
from .grammar import GrammarMask, GrammarMatcher, advance
from .lifetime import close_at_exit
from .request import Completion, GenerationRequest, Policy, TokenCallback, new_request
from .sampler import sample, sampling_tensors
from .sampling_params import SamplingParams, row_seed
from .stopping import completion_of, finish_reason_of

__all__ = ["HFEngine", "kv_cache_kwargs"]


@dataclass(slots=True)
class _Row:
    """The state of one sample while it decodes."""

    request: GenerationRequest
    sample_index: int
    max_tokens: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    grammar: GrammarMatcher | None = None  # structured outputs: this sample's matcher
    forced: list[bool] = field(default_factory=list)



def kv_cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that passes a KV cache to `model`'s forward: `cache` where transformers has
    renamed it (5.2x; `past_key_values` is deprecated there and removed in 5.40), else
    `past_key_values`. `model`: a transformers model, or a PEFT model around one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    return {name: cache}

class HFEngine:
    """Batched sampling with logprobs on a transformers model.

    Args:
        model: a `transformers` causal LM (LoRA layers may be injected into it).
        tokenizer: its tokenizer, used to detect stop strings and decode text.
        stop_token_ids: ids that end a sample (end of turn).
        lock: held for each batch; the trainer takes it for each step.
        max_batch_size: most samples decoded together.
        max_seq_len: prompt + completion limit in tokens (the model's context length).
        batch_quiet_s: after a request arrives, wait this long for more before starting a batch
            (rollouts launched together reach the server over some milliseconds).
        batch_wait_max_s: but never wait longer than this in total.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        stop_token_ids: list[int],
        lock: threading.RLock,
        max_batch_size: int = 64,
        max_seq_len: int = 8192,
        batch_quiet_s: float = 0.02,
        batch_wait_max_s: float = 0.2,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.lock = lock
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.batch_quiet_s = batch_quiet_s
        self.batch_wait_max_s = batch_wait_max_s
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._rng = random.Random()
        self._thread = threading.Thread(target=self._loop, name="tempering-engine", daemon=True)
        self._thread.start()
        close_at_exit(self)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- public API -------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, n: int = 1, policy: Policy,
               on_token: TokenCallback | None = None):
        """Queue a request; returns a `concurrent.futures.Future` of `n` Completions.

        Raises:
            ConfigError: if the prompt is empty or leaves no room for a token in the context.
            EngineError: if the engine is closed.
        """
        request = new_request(prompt_ids, params, n, policy, on_token, max_seq_len=self.max_seq_len,
                              limits=f"the model's context is {self.max_seq_len}")
        with self._cond:
            if self._closed:
                raise EngineError("the engine is closed; register the model with a new backend")
            self._queue.append(request)
            self._cond.notify()
        return request.future

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, n: int = 1, policy: Policy) -> list[Completion]:
        """`submit` for asyncio callers."""
        return await asyncio.wrap_future(self.submit(prompt_ids, params, n=n, policy=policy))

    def abort(self, future) -> None:
        """Cancel the request behind `future` if it is still queued (a batch already running
        finishes: transformers' `generate` cannot be stopped part-way)."""
        future.cancel()

    def close(self) -> None:
        """Stop the worker; queued requests fail with EngineError. A second call does nothing."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        while self._queue:
            future = self._queue.popleft().future
            if not future.done():  # (a queued request may have been cancelled: `abort`)
                future.set_exception(EngineError("the engine was closed before this request ran"))

    # ---- worker -----------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.device.type == "cuda":  # the current device is per thread: Triton and CUDA graphs launch on it
            torch.cuda.set_device(self.device)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:  # every request taken was cancelled meanwhile
                continue
            try:
                completions = self._run_batch(batch)
            except BaseException as exc:  # never let the worker die: fail this batch's requests
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(EngineError(f"generation failed: {exc!r}"))
                continue
            for request, result in zip(batch, completions):
                request.future.set_result(result)

    def _next_batch(self) -> list[GenerationRequest] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            # let requests sent at about the same moment join this batch: wait until none has
            # arrived for batch_quiet_s, the batch is full, or batch_wait_max_s has passed
            deadline = time.monotonic() + self.batch_wait_max_s
            while sum(r.n for r in self._queue) < self.max_batch_size:
                size = len(self._queue)
                timeout = min(self.batch_quiet_s, deadline - time.monotonic())
                if timeout <= 0:
                    break
                self._cond.wait(timeout)
                if self._closed:
                    return None
                if len(self._queue) == size:
                    break
            key = self._queue[0].policy.key
            batch, rest, num_rows = [], collections.deque(), 0
            while self._queue:
                request = self._queue.popleft()
                fits = num_rows + request.n <= self.max_batch_size or not batch
                if request.policy.key == key and fits and request.future.set_running_or_notify_cancel():
                    batch.append(request)
                    num_rows += request.n
                elif not request.future.cancelled():
                    rest.append(request)
            self._queue.extendleft(reversed(rest))
            return batch

    def _run_batch(self, batch: list[GenerationRequest]) -> list[list[Completion]]:
        rows = []
        for request in batch:
            room = self.max_seq_len - len(request.prompt_ids)
            for i in range(request.n):
                seed = row_seed(request.params.seed, i, self._rng)
                grammar = request.params.grammar.matcher() if request.params.grammar is not None else None
                rows.append(_Row(request, i, min(request.params.max_tokens, room), seed, grammar=grammar))
        with self.lock, batch[0].policy.activate(), torch.inference_mode():
            was_training = self.model.training
            self.model.eval()
            try:
                self._decode(rows)
            finally:
                self.model.train(was_training)
        return [[self._completion(r) for r in rows if r.request is request] for request in batch]

    def _decode(self, rows: list[_Row]) -> None:
        from transformers import DynamicCache

        device = self.device
        B = len(rows)
        T = max(len(r.request.prompt_ids) for r in rows)
        input_ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((B, T), dtype=torch.long)
        for b, r in enumerate(rows):  # left padding: every row's next token lands in the same column
            ids = r.request.prompt_ids
            input_ids[b, T - len(ids):] = torch.tensor(ids)
            attention_mask[b, T - len(ids):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        cache = DynamicCache()
        active = list(range(B))  # indices into rows of the cache's rows, in cache order
        while True:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **kv_cache_kwargs(self.model, cache),
            )
            logits = out.logits[:, -1, :]  # [B', V]
            live = [rows[i] for i in active]
            options = sampling_tensors(
                [r.request.params for r in live], [r.seed for r in live], [len(r.token_ids) for r in live], device
            )
            grammar_mask = GrammarMask.fill([r.grammar for r in live], device)
            result = sample(logits, options, grammar_mask)
            ids = result.token_ids.tolist()  # the one device→host sync per step
            lps = result.logprobs.tolist()
            if grammar_mask is not None:
                for r, is_forced in zip(live, grammar_mask.forced()):
                    if r.grammar is not None:
                        r.forced.append(is_forced)
                advance([(r.grammar, ids[j]) for j, r in enumerate(live) if r.grammar is not None])
            tops = None
            if result.top_ids is not None:
                tops = list(zip(result.top_ids.tolist(), result.top_logprobs.tolist()))
            keep = []
            for j, r in enumerate(live):
                self._append(r, ids[j], lps[j], tops[j] if tops else None)
                if r.finish_reason is None:
                    keep.append(j)
            if not keep:
                return
            next_ids = torch.tensor([[ids[j]] for j in keep], device=device)  # [B', 1]
            if len(keep) < len(live):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention_mask = attention_mask[index]
                position_ids = position_ids[index]
                active = [active[j] for j in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(keep), 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            input_ids = next_ids

    def _append(self, row: _Row, token_id: int, logprob: float, top: tuple[list[int], list[float]] | None) -> None:
        k = row.request.params.num_top_logprobs
        row.token_ids.append(token_id)
        row.logprobs.append(logprob)
        row.policy_versions.append(row.request.policy.version)  # read under `lock`, held for the whole batch
        row.top_logprobs.append(list(zip(top[0][:k], top[1][:k])) if top and k else [])
        row.finish_reason = finish_reason_of(
            row.token_ids, row.request.params, row.max_tokens, self.stop_token_ids, self.tokenizer
        )
        if row.request.on_token is not None:
            row.request.on_token(row.sample_index, token_id, logprob, row.top_logprobs[-1])

    def _completion(self, row: _Row) -> Completion:
        return completion_of(
            row.token_ids, row.logprobs, row.top_logprobs, row.finish_reason, row.request.params, self.tokenizer,
            forced=row.forced if row.grammar is not None else None,
            policy_versions=row.policy_versions,
        )
