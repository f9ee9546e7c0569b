"""The continuous-batching engine: requests in, one scheduler step at a time, completions out.

A worker thread owns the scheduler, block manager and model runner. `submit()` (any thread)
queues a request and returns a Future; the worker turns it into n sequences, steps while there
is work, and resolves the Future when all n samples are done.

Steps are pipelined one deep: the worker schedules and launches step t+1 before it collects the
tokens of step t, so on a GPU the host work of a step (scheduling, building inputs, reading
tokens back, stop checks) runs while the device computes. A sequence whose token is still being
sampled holds a `PENDING` placeholder, which the next step reads on the device; a sample that
turns out to have ended (a stop token) drops the one extra token computed for it. A step with
rows under a grammar (structured outputs) is launched up to its logits and sampled once the
previous step's tokens advanced the grammars' matchers (their bitmasks need them); a helper
thread fills the bitmasks while the worker prepares the step after (`_step`).

Launching a step holds `lock`, which the trainer takes while it changes weights; a launch sees
either the old weights or the new ones, and the device runs the work in launch order. A sequence
that spans a training step samples its later tokens from the new policy; each token's logprob
and policy version are recorded under the policy that sampled them.

Tensor parallelism (`model.tp`, modeling/tensor_parallel.py): the engine of the group's leader (TP rank 0)
is the one above, and its runner broadcasts every forward's inputs before running it
(tensor_parallel.py). On the other ranks the engine is a follower: its worker only runs the
forwards it receives, on its own shards and KV cache, until the leader's engine closes; it takes
no requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, EngineError, RequestAborted
from .block_manager import BlockManager
from .config import EngineConfig
from .grammar import GrammarMask, MaskWorker, ReadyMasks
from .grammar import advance as advance_grammars
from .lifetime import close_at_exit
from .lora import EngineAdapter, collect_adapter
from .memory import release_free_memory
from .model_runner import LaunchedStep, ModelRunner, SampledTokens
from .models import LlamaFamilyModel
from .request import Completion, GenerationRequest, Policy, TokenCallback, new_request
from .routing import token_slots
from .sampling_params import SamplingParams, row_seed
from .scheduler import ScheduledBatch, Scheduler
from .scoring import score_sequences
from .sequence import PENDING, Sequence
from .stopping import completion_of, finish_reason_at
from .tensor_parallel import PAUSE, STEP, STOP, StepLink

__all__ = ["Engine", "EngineStats"]

log = logging.getLogger("tempering")

_NO_TOP: tuple = ()  # the top logprobs of a token when none were asked for: one shared object, not a list per token


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started."""

    num_steps: int = 0  # forwards launched (a tensor-parallel follower: the leader's steps it has run)
    num_prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (the host tier's included)
    num_offloaded_tokens: int = 0  # token slots of the blocks copied to the host tier (KV offloading)
    num_restored_tokens: int = 0  # token slots of the blocks copied back from it instead of prefilled
    num_decode_tokens: int = 0
    num_preemptions: int = 0


class Engine:
    """Continuous batching with a paged KV cache over a LlamaFamilyModel.

    Args:
        model: the engine's decoder, bound to the HF model's weights.
        tokenizer: for stop strings and text.
        stop_token_ids: ids that end a sample.
        lock: held during each step; the trainer holds it while it writes the weights.
        config: batching and cache settings.
        max_seq_len: the model's context length.
        peft_model: returns the PEFT model whose adapters requests name (None before training).

    Attributes:
        mask_thread: fill grammar bitmasks on a helper thread while this engine's worker prepares
            the next step (default); False fills them on the worker itself (for measurements).
    """

    def __init__(
        self,
        model: LlamaFamilyModel,
        tokenizer: Any,
        *,
        stop_token_ids: list[int],
        lock: threading.RLock,
        config: EngineConfig | None = None,
        max_seq_len: int = 8192,
        peft_model: Callable[[], Any] = lambda: None,
        on_group_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self._stop_ids = frozenset(stop_token_ids)
        self.lock = lock
        self.config = (config or EngineConfig()).for_device(model.device.type)
        self._peft_model = peft_model
        self._adapters: dict[tuple[str, int], EngineAdapter] = {}
        tp = getattr(model, "tp", None)
        if self.config.tensor_parallel_size != (tp.size if tp is not None else 1):
            raise ConfigError(f"EngineConfig.tensor_parallel_size is {self.config.tensor_parallel_size} but the "
                              f"model is sharded for {tp.size if tp is not None else 1} ranks "
                              "(modeling.tensor_parallel.shard_llama_ and "
                              "LlamaFamilyModel(tp=...)): make them equal")
        self.link = StepLink(tp, model.device) if tp is not None else None
        self.is_follower = tp is not None and not tp.is_leader
        self._batch_adapters: dict[str, EngineAdapter] = {}  # the scheduled batch's, resolved once (_step)
        self.runner = ModelRunner(model, self.config, self._adapter_for_batch, max_seq_len, link=self.link)
        host = self.runner.host_cache
        self.blocks = BlockManager(self.runner.num_blocks, self.config.block_size,
                                   enable_prefix_caching=self.config.enable_prefix_caching,
                                   num_host_blocks=host.num_slots if host is not None else 0)
        self.scheduler = Scheduler(self.config, self.blocks)
        if self.runner.routing is not None:
            self.scheduler.on_preempt = self._keep_routing
        self.max_seq_len = min(max_seq_len, self.blocks.capacity_tokens)
        self._inbox: collections.deque[GenerationRequest] = collections.deque()
        self._aborts: collections.deque = collections.deque()  # futures of requests to stop
        self._pending: dict[int, list[Sequence]] = {}  # id(request) -> its sequences
        self._awaiting: list[list[Sequence]] = []  # finished requests whose routed experts are still being copied
        self._cond = threading.Condition()
        self._closed = False
        # tensor parallelism: a step that failed on one rank leaves the others waiting in its
        # collectives, so this rank's engine stops and `on_group_failure(error)` (from the engine's
        # thread) stops the run; None: logged only
        self._on_group_failure = on_group_failure
        self._group_error: EngineError | None = None
        self._pauses = self._pauses_taken = 0  # a follower's PAUSE messages received / waited for
        self._rng = random.Random()
        self._in_flight: LaunchedStep | None = None  # the newest launched step
        self._to_collect: LaunchedStep | None = None  # the step launched before it, not yet collected
        self._masks: MaskWorker | None = None
        self.mask_thread = True
        self.stats = EngineStats()
        self._thread = threading.Thread(target=self._follow if self.is_follower else self._loop,
                                        name="tempering-engine", daemon=True)
        self._thread.start()
        close_at_exit(self)

    @property
    def device(self):
        return self.model.device

    @property
    def is_idle(self) -> bool:
        """Whether the engine has nothing queued, running or in flight on the device (a snapshot,
        read without the worker's lock: a request may arrive the next moment)."""
        return not (self._inbox or self._pending or self._launched or self._awaiting)

    # ---- public API ---------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, n: int = 1, policy: Policy,
               on_token: TokenCallback | None = None):
        """Queue a request; returns a `concurrent.futures.Future` of `n` Completions.

        Raises:
            ConfigError: if the prompt is empty or does not fit in the context or the KV cache.
            EngineError: if the engine is closed, or is a tensor-parallel follower.
        """
        if self.is_follower:
            raise EngineError("this engine is a tensor-parallel follower (TP rank > 0): submit requests to the "
                              "group's leader (TP rank 0), which runs them on every rank")
        request = new_request(prompt_ids, params, n, policy, on_token, max_seq_len=self.max_seq_len,
                              limits=f"context {self.max_seq_len}, KV cache {self.blocks.capacity_tokens} tokens",
                              vocab_size=self.model.embed.shape[0])
        with self._cond:
            if self._group_error is not None:
                raise self._group_error
            if self._closed:
                raise EngineError("the engine is closed; register the model with a new backend")
            self._inbox.append(request)
            self._cond.notify()
        return request.future

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, n: int = 1, policy: Policy) -> list[Completion]:
        """`submit` for asyncio callers; cancelling the caller aborts the request (`abort`)."""
        future = self.submit(prompt_ids, params, n=n, policy=policy)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # a running request's future cannot be cancelled: stop its samples
            self.abort(future)
            raise

    def abort(self, future) -> None:
        """Stop the request behind `future` (from `submit`), e.g. when its client went away.

        A request still queued is cancelled; a running one has its samples ended at the worker's
        next step, their KV blocks freed, and its future fails with RequestAborted. A request
        already done is left as it is. Any thread.
        """
        if future.cancel():  # not admitted yet
            return
        with self._cond:
            if not self._closed and not future.done():
                self._aborts.append(future)
                self._cond.notify()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the worker; unfinished requests fail with EngineError. A second call does nothing.

        A tensor-parallel leader also stops its followers (unless its group failed: they wait in
        a collective and cannot hear it); a follower waits (up to `timeout_s`) for that. A worker
        still inside a step after `timeout_s` (e.g. waiting for a long training step's weights)
        fails its own unfinished requests when the step returns; the queued ones fail at once.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        stopped = not self._thread.is_alive()
        if self.link is not None and not self.is_follower and stopped and self._group_error is None:
            self.link.send_stop()
        if stopped:  # (a worker still running may replay them)
            self.runner.close()
        if self._masks is not None:
            self._masks.close()
        with self._cond:  # the worker takes no request from the inbox once closed
            futures = [r.future for r in self._inbox]
            self._inbox.clear()
        if stopped:
            futures += self._unfinished()
        else:  # the worker owns its requests until it returns (it fails them then: `_loop`)
            log.warning("the engine's worker did not stop within %.0f s; its running requests fail when its step "
                        "returns", timeout_s)
        self._fail_futures(futures)

    def _unfinished(self) -> list[Future]:
        """The futures of every admitted request not yet completed (the worker's, or after it stopped)."""
        return [seqs[0].request.future for seqs in list(self._pending.values()) + list(self._awaiting)]

    @staticmethod
    def _fail_futures(futures: list[Future]) -> None:
        error = EngineError("the engine was closed before this request finished")
        for future in futures:
            if not future.done():  # (a queued request may have been cancelled: `abort`)
                future.set_exception(error)

    # ---- tensor parallelism: a training step between two engine steps -------------------------

    @contextlib.contextmanager
    def paused_for_training(self, timeout_s: float = 600.0) -> Iterator[None]:
        """Around a training call on this rank's weights (with the trainer's stream current): holds
        `lock` throughout, so no engine step runs meanwhile. Under tensor parallelism a follower
        first waits for its leader's pause (`wait_for_leader_pause`), and the leader, once it holds
        `lock`, sends it (`pause_followers`): every rank then issues the trainer's collectives after
        the same engine steps.

        Raises:
            EngineError: as `wait_for_leader_pause`, or if this rank's tensor-parallel engine failed.
        """
        if self._group_error is not None:
            raise self._group_error
        self.wait_for_leader_pause(timeout_s)
        with self.lock:
            self.pause_followers()
            yield

    def pause_followers(self) -> None:
        """A tensor-parallel leader, as a training call on its shards begins, holding `lock` (so that
        no engine step launches until the call ends): tell the followers that every step is sent.
        A no-op without tensor parallelism.

        NCCL orders nothing between two communicators: every rank must issue the engine's
        collectives and the trainer's in the same order, or a rank's training all-reduce can spin
        on the GPU while the engine all-reduce another rank waits for sits behind it (and any
        device-wide synchronization, such as loading a kernel, then hangs both). So under tensor
        parallelism a training call pauses the replica's engine: the leader holds `lock` for the
        whole call and sends this; each follower's call starts once its engine has launched every
        step sent before it (`wait_for_leader_pause`).
        """
        if self.link is not None and not self.is_follower:
            self.link.send_pause()

    def wait_for_leader_pause(self, timeout_s: float = 600.0) -> None:
        """A tensor-parallel follower, before a training call on its shards (and before taking
        `lock`, which its engine needs to launch the leader's last steps): wait until its engine
        has received the leader's next `pause_followers`, having launched every step sent before
        it. A no-op without tensor parallelism.

        Raises:
            EngineError: if the leader sends no pause within `timeout_s` seconds (its training call
                did not start, or its process died), or this engine is closed.
        """
        if not self.is_follower:
            return
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pauses <= self._pauses_taken:
                if self._group_error is not None:
                    raise self._group_error
                left = deadline - time.monotonic()
                if self._closed or not self._thread.is_alive() or left <= 0:
                    raise EngineError(
                        f"this tensor-parallel follower waited {timeout_s:.0f} s for its leader (TP rank 0) to pause "
                        "its engine for the training step; the leader's process is stuck or gone: see its log")
                self._cond.wait(min(left, 1.0))
            self._pauses_taken += 1

    # ---- adapters -------------------------------------------------------------------------------

    def _adapter_weights(self, name: str) -> EngineAdapter:
        peft_model = self._peft_model()
        if peft_model is None:
            raise EngineError(f"adapter {name!r} was requested but the model has no adapters")
        key = (name, id(peft_model))
        weights = self._adapters.get(key)
        if weights is None:
            if name not in peft_model.peft_config:
                raise EngineError(f"adapter {name!r} is not loaded")
            hidden = self.model.hidden_size
            weights = EngineAdapter(collect_adapter(self.model.hf_layers, name, self.model.fused_slices),
                                    {"o": hidden, "down": hidden})
            for stale in [k for k in self._adapters if k[1] != id(peft_model)]:  # a replaced PEFT model
                self.runner.forget_adapter(self._adapters.pop(stale))
            self._adapters[key] = weights
        return weights

    def score(self, sequences: list[list[int]], temperatures: list[list[float]], policy: Policy,
              routed_experts: list | None = None) -> list[list[float]]:
        """Teacher-forced logprobs of `sequences` under `policy`'s weights, by this engine's forward
        (scoring.py), between two engine steps.

        With `EngineConfig.batch_invariant` each value is bitwise the logprob the engine returned
        when it sampled that token with the same weights.

        Args:
            sequences: token ids, each at least 2 long.
            temperatures: per sequence and token, the temperature of its logprob (entry 0 unused).
            policy: whose adapter to apply (its `adapter_name`; None: the base model).
            routed_experts: per sequence, [len, L_moe, k] expert ids (a mixture of experts: routing
                replay, as the trainer routes them) or None.

        Returns:
            per sequence, the logprobs of its tokens 1..len-1, float32 values.
        """
        if self.link is not None:
            raise EngineError("Engine.score runs one process's forward; it is not available under tensor parallelism "
                              "(tensor_parallel_size > 1)")
        with self.lock:
            name = policy.adapter_name
            adapter = self._adapter_weights(name) if name else None
            return score_sequences(self.model, sequences, temperatures, adapter, block_size=self.config.block_size,
                                   max_tokens=max(self.config.max_num_batched_tokens, 8192), bind=self.model.bind_lora,
                                   routed_experts=routed_experts)

    def forget_adapter(self, name: str) -> None:
        """Drop every reference to an adapter that is being unloaded (call it under `lock`)."""
        for key in [k for k in self._adapters if k[0] == name]:
            self.runner.forget_adapter(self._adapters.pop(key))

    def _adapter_for_batch(self, name: str) -> EngineAdapter:
        """The runner's lookup: the adapter resolved for the scheduled batch, else the current one."""
        adapter = self._batch_adapters.get(name)
        return adapter if adapter is not None else self._adapter_weights(name)

    def adapter_in_use(self, name: str) -> bool:
        """Whether a queued or running request samples with adapter `name` (a snapshot: a request
        may arrive the next moment; one whose adapter is gone when its step comes fails alone)."""
        requests = list(self._inbox) + [seqs[0].request for seqs in list(self._pending.values())]
        return any(r.policy.adapter_name == name for r in requests)

    def _without_unloaded_adapters(self, batch):
        """`batch` less the samples whose adapter was unloaded while they waited or ran; their
        requests fail with the reason, the others go on."""
        names = {seq.request.policy.adapter_name for seq, _ in batch.items()} - {None}
        resolved, gone = {}, {}
        for name in names:
            try:
                resolved[name] = self._adapter_weights(name)
            except EngineError as exc:
                gone[name] = exc
        self._batch_adapters = resolved  # the step's, even if one is unloaded before it is prepared
        if not gone:
            return batch
        for seq, _ in batch.items():
            name = seq.request.policy.adapter_name
            if name in gone and not seq.is_finished:
                self._fail_request(seq.request, EngineError(
                    f"{gone[name]} (unloaded while this request waited or ran: a server keeps the most recently "
                    f"used saved steps loaded); send the request again"))
        batch.decode = [s for s in batch.decode if not s.is_finished]
        batch.prefill = [(s, n) for s, n in batch.prefill if not s.is_finished]
        return batch

    # ---- worker ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.device.type == "cuda":  # the current device is per thread: Triton and CUDA graphs launch on it
            torch.cuda.set_device(self.device)
        while True:
            with self._cond:
                idle = not self._inbox and not self.scheduler.has_work and not self._launched
                if idle and self.stats.num_steps and self.device.type == "cpu":
                    release_free_memory()  # going idle: hand the step's temporaries back to the OS
                while not self._inbox and not self.scheduler.has_work and not self._launched and not self._closed:
                    self._cond.wait()
                if self._closed:  # its own requests fail here (close() fails them too if it saw the worker stop)
                    self._fail_futures(self._unfinished())
                    return
                arrivals = list(self._inbox)
                self._inbox.clear()
                aborts = list(self._aborts)
                self._aborts.clear()
            for request in arrivals:
                try:
                    self._admit(request)
                except Exception as exc:  # this request alone: the worker goes on
                    log.exception("admitting a request failed")
                    self._fail_request(request, EngineError(f"the request could not be admitted: {exc!r}"))
            for future in aborts:
                self._abort(future)
            if not self.scheduler.has_work and not self._launched:
                continue
            try:
                self._step()
            except BaseException as exc:  # never let the worker die: fail what was running
                log.exception("engine step failed")
                self._fail_all(EngineError(f"generation failed: {exc!r}"))
                if self.link is not None:  # its followers may wait in this step's collectives
                    self._stop_group(exc)
                    return

    def _stop_group(self, exc: BaseException) -> None:
        """A tensor-parallel engine failed on this rank: refuse new requests and report it, once."""
        with self._cond:
            if self._group_error is not None:
                return
            self._group_error = error = EngineError(
                f"the tensor-parallel engine failed on this rank ({exc!r}); the other ranks of its group wait for it "
                "in a collective, so the run stops: start the backend again")
            queued = list(self._inbox)
            self._inbox.clear()
            self._cond.notify_all()
        for request in queued:
            if not request.future.done():
                request.future.set_exception(error)
        if self._on_group_failure is not None:
            try:
                self._on_group_failure(exc)
            except Exception:
                log.exception("stopping the run after the engine's failure failed")

    def _follow(self) -> None:
        """A tensor-parallel follower's worker: run the leader's forwards until it stops."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while True:
                message = self.link.recv()
                if message.kind == STOP:
                    return
                if message.kind == PAUSE:
                    with self._cond:
                        self._pauses += 1
                        self._cond.notify_all()
                    continue
                self._follow_one(message)
                if message.kind == STEP:  # the leader's steps this follower has launched
                    self.stats.num_steps += 1
        except BaseException as exc:
            log.exception("the tensor-parallel follower engine failed: the group's leader waits for it")
            self._stop_group(exc)
            raise

    def _follow_one(self, message, timeout_s: float = 600.0) -> None:
        """Run one of the leader's steps, once this rank has the adapters it names: the ranks create
        their trainers (and PEFT's LoRA layers) independently, so the leader may use the live adapter
        a moment before this rank has it. Waits for them without holding the lock (creating a trainer
        takes it)."""
        names = {name for _, _, name in message.segments}
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:  # as the leader's launch: the trainer does not write the adapter meanwhile
                try:
                    adapters = {name: self._adapter_weights(name) for name in names}
                except EngineError:
                    if time.monotonic() > deadline:
                        raise
                else:
                    self.runner.follow(message, adapters)
                    return
            time.sleep(0.002)

    @property
    def _launched(self) -> bool:
        """Whether a launched step is still to be collected."""
        return self._in_flight is not None or self._to_collect is not None

    def _admit(self, request: GenerationRequest) -> None:
        if not request.future.set_running_or_notify_cancel():
            return
        room = self.max_seq_len - len(request.prompt_ids)
        max_tokens = min(request.params.max_tokens, room)
        seqs = [
            Sequence.from_request(request, i, row_seed(request.params.seed, i, self._rng), max_tokens)
            for i in range(request.n)
        ]
        self._pending[id(request)] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def _abort(self, future) -> None:
        """End every sample of the request behind `future` now (tokens still being sampled are dropped)."""
        key = next((k for k, seqs in self._pending.items() if seqs[0].request.future is future), None)
        if key is None:  # finished (or failed) meanwhile
            return
        self._end_samples(key)
        if not future.done():
            future.set_exception(RequestAborted("the request was aborted (its client went away or cancelled it)"))

    def _fail_request(self, request: GenerationRequest, error: BaseException) -> None:
        """End one request's samples and fail its future with `error`; the others go on."""
        if id(request) in self._pending:
            self._end_samples(id(request))
        if not request.future.done():
            request.future.set_exception(error)

    def _end_samples(self, key: int) -> None:
        """Finish every sample of the pending request `key` now and free its blocks."""
        for seq in self._pending.pop(key):
            if seq.is_finished:
                continue
            if seq.num_pending:  # a launched step's token for it is skipped when collected (_process)
                del seq.token_ids[len(seq.token_ids) - seq.num_pending:]
                seq.num_pending = 0
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            self.runner.release(seq)

    def _step(self) -> None:
        """One turn of the pipeline: collect the older launched step, launch the next one.

        With t+1 the newest launched step (its sampling deferred when it has grammar rows) and t
        the one before it (sampled, not collected):
        1. collect t's tokens (sampled before t+1's forward was queued, so this rarely waits);
        2. when t+1 waits for grammar masks, a helper thread has the matchers consume t's tokens
           and fill t+1's bitmasks (llguidance works without the GIL), while this thread
        3. processes t's tokens (stops, completions), schedules t+2 and prepares its inputs
           (sending them to the device): the consume runs beside the processing and scheduling,
           the fill beside the preparing;
        4. stages t+2 (its inputs into its CUDA graph's buffers) while the helper may still be
           filling, then samples t+1 with the masks and launches t+2's forward, which queues right
           behind: only the sampling and the graph launch stand between the masks and the forward.
        So the host work of a step overlaps the device's forward also under structured outputs.
        """
        older, newest = self._to_collect, self._in_flight
        sampled = self.runner.collect(older) if older is not None else None
        consume = None  # t's tokens, for the grammars' matchers
        if sampled is not None:
            consume = [(seq.grammar, token_id) for seq, token_id in zip(sampled.seqs, sampled.token_ids)
                       if seq.grammar is not None and not seq.is_finished]
        masks = None
        if newest is not None and newest.deferred is not None:
            matchers = [None if s.is_finished else s.grammar for s in newest.seqs]
            if self.mask_thread:  # the helper consumes t's tokens, then fills t+1's masks
                masks = self._mask_worker().submit(matchers, pinned=self.runner.is_cuda, consume=consume)
            else:
                masks = ReadyMasks(GrammarMask.compute(matchers, pinned=self.runner.is_cuda, consume=consume))
        elif consume:
            advance_grammars(consume)
        if sampled is not None:
            self._process(sampled)
        batch = _grouped_by_adapter(self._without_unloaded_adapters(self.scheduler.schedule()))
        if self.blocks.transfers:  # KV blocks to and from the host tier, queued before this step's forward
            self.runner.transfer(self.blocks.take_transfers())
        if masks is not None:  # let the helper into its fill call (the GIL: see MaskWorker)
            masks.wait_filling()
        prepared = self.runner.prepare(batch, newest) if batch else None
        launched = None
        # held from staging to launch: the adapter copy staged and the version stamped stay the step's
        with self.lock:
            if prepared is not None:  # t+2's inputs into its graph's buffers while the masks are filled
                self.runner.stage(prepared)
            if masks is not None:  # t+1's sampling goes in the device's queue before t+2's forward, which reads it
                self.runner.sample_deferred(newest, masks)
            if prepared is not None:
                launched = self.runner.launch(prepared)
                if launched is not None:  # the version of the weights this step reads, stamped on its tokens
                    launched.versions = [s.request.policy.version for s in launched.seqs]
        if prepared is not None:
            stats = self.stats
            stats.num_steps += 1
            stats.num_decode_tokens += len(batch.decode)
            stats.num_preemptions = self.scheduler.num_preemptions
            stats.num_offloaded_tokens = self.blocks.num_offloaded_blocks * self.config.block_size
            stats.num_restored_tokens = self.blocks.num_restored_blocks * self.config.block_size
            for seq, n in batch.prefill:
                stats.num_prefill_tokens += n
                if seq.num_computed_tokens == seq.num_cached_tokens:  # its first chunk
                    stats.num_cached_tokens += seq.num_cached_tokens
                    if not seq.num_preemptions:
                        seq.num_first_cached_tokens = seq.num_cached_tokens
            for seq, n in batch.items():
                seq.num_computed_tokens += n
            if launched is not None:
                for seq in launched.seqs:  # the token this step samples, until it arrives
                    launched.indices.append(len(seq.token_ids))
                    seq.token_ids.append(PENDING)
                    seq.num_pending += 1
        elif newest is None and older is None:
            raise EngineError("the scheduler could not place any request (KV cache too small?)")
        self._to_collect, self._in_flight = newest, launched
        if self._awaiting:  # nothing left in flight: wait for the copies now (the device is idle anyway)
            self._complete_awaiting(wait=newest is None and launched is None)

    def _mask_worker(self) -> MaskWorker:
        """The helper thread that fills grammar bitmasks (started on first use)."""
        if self._masks is None:
            self._masks = MaskWorker()
        return self._masks

    def _process(self, sampled: SampledTokens) -> None:
        """Fill in a collected step's tokens; finish the samples that end with them."""
        tops = sampled.top
        finished: list[Sequence] = []
        to_gather: list[tuple[Sequence, Any]] = []  # finished samples' routed experts: (sample, their slots)
        for j, seq in enumerate(sampled.seqs):
            if seq.is_finished:  # ended at an earlier token; this one was computed for nothing
                continue
            index, token_id, logprob = sampled.indices[j], sampled.token_ids[j], sampled.logprobs[j]
            top = tops[j] if tops is not None else _NO_TOP
            seq.token_ids[index] = token_id
            seq.num_pending -= 1
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top)
            seq.policy_versions.append(sampled.versions[j])
            if seq.grammar is not None:
                seq.forced.append(sampled.forced[j])
            seq.finish_reason = finish_reason_at(seq.token_ids, index, index + 1 - seq.num_prompt_tokens,
                                                 seq.request.params, seq.max_tokens, self._stop_ids, self.tokenizer)
            if seq.request.on_token is not None:
                try:
                    seq.request.on_token(seq.sample_index, token_id, logprob, top)
                except Exception as exc:  # this request's streaming failed: stop it alone
                    log.warning("a request's token callback raised %r; that request is stopped", exc)
                    self._fail_request(seq.request, EngineError(f"the request's token callback raised {exc!r}"))
                    continue
            if seq.finish_reason is not None:
                del seq.token_ids[index + 1:]  # a token launched after this one
                seq.num_pending = 0
                finished.append(seq)
                if seq.request.params.return_routed_experts and self.runner.routing is not None:
                    if seq.block_table:  # the slots of every token that was an input, read before its blocks are freed
                        to_gather.append((seq, token_slots(seq.block_table, len(seq.token_ids) - 1, self.runner.block_size)))
                    else:  # preempted while this last token was being sampled: the experts kept then
                        seq.routing = seq.routing_at_preemption
                self.scheduler.finish(seq)
                self.runner.release(seq)
        if to_gather:  # one gather for the step, queued before any later step can reuse the freed blocks
            pending = self.runner.routing.gather([slots for _, slots in to_gather])
            for i, (s, _) in enumerate(to_gather):
                s.routing = (pending, i)
        for seq in finished:
            self._maybe_complete(seq.request)

    def _keep_routing(self, seq: Sequence) -> None:
        """(The scheduler, before freeing a preempted sample's blocks.) A sample that asked for its
        routed experts and has a token being sampled may finish with that token before it is
        recomputed: start copying its inputs' experts now, while their slots still hold them."""
        if seq.num_pending and seq.request.params.return_routed_experts:
            slots = token_slots(seq.block_table, seq.num_computed_tokens, self.runner.block_size)
            seq.routing_at_preemption = (self.runner.routing.gather([slots]), 0)

    def _maybe_complete(self, request: GenerationRequest) -> None:
        seqs = self._pending.get(id(request))
        if seqs is None or not all(s.is_finished for s in seqs):  # None: completed at an earlier sample
            return
        del self._pending[id(request)]
        if any(s.routing is not None and not s.routing[0].ready() for s in seqs):
            self._awaiting.append(seqs)  # completed once the copy of its routed experts is done
            return
        self._complete(seqs)

    def _complete(self, seqs: list[Sequence]) -> None:
        completions = []
        for s in seqs:
            c = completion_of(s.completion_ids, s.logprobs, s.top_logprobs, s.finish_reason, s.request.params,
                              self.tokenizer, forced=s.forced if s.grammar is not None else None,
                              policy_versions=s.policy_versions)
            c.num_cached_tokens = s.num_first_cached_tokens
            if s.routing is not None:  # (kept at a preemption it may hold a token launched after the last)
                c.routed_experts = s.routing[0].array(s.routing[1])[:len(s.token_ids) - 1]
            completions.append(c)
        seqs[0].request.future.set_result(completions)

    def _complete_awaiting(self, *, wait: bool) -> None:
        """Complete the requests whose routed experts reached the host (all of them when `wait`)."""
        still = []
        for seqs in self._awaiting:
            if wait or all(s.routing is None or s.routing[0].ready() for s in seqs):
                self._complete(seqs)
            else:
                still.append(seqs)
        self._awaiting = still

    def _fail_all(self, error: EngineError) -> None:
        self._in_flight = self._to_collect = None
        for seqs in list(self._pending.values()):
            for seq in seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    self.runner.release(seq)
            if not seqs[0].request.future.done():
                seqs[0].request.future.set_exception(error)
        self._pending.clear()
        for seqs in self._awaiting:
            if not seqs[0].request.future.done():
                seqs[0].request.future.set_exception(error)
        self._awaiting = []
        self.blocks.forget_cached()  # blocks of the failed step may hold garbage


def _grouped_by_adapter(batch: ScheduledBatch) -> ScheduledBatch:
    """`batch` with its decode rows, and its prefill chunks, each in adapter order (stable), when it
    mixes adapters: each adapter's rows are then one LoRA segment (one shrink and one expand per
    projection), not one per request. Rows are matched to sequences by id, not position."""
    names = {seq.request.policy.adapter_name for seq, _ in batch.items()}
    if len(names) > 1:
        batch.decode = sorted(batch.decode, key=lambda seq: seq.request.policy.adapter_name or "")
        batch.prefill = sorted(batch.prefill, key=lambda item: item[0].request.policy.adapter_name or "")
    return batch
