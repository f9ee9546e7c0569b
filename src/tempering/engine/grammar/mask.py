"""One step's allowed tokens for the rows of a batch that follow a grammar, and the step after.

Per step, in this order:
1. `GrammarMask.fill(matchers, device)` (host): llguidance writes each constrained
   row's allowed-token bitmask (bit t % 32 of int32 word t // 32 set = token t allowed) into a
   pinned buffer, which is copied to the device without blocking. Call it after the forward pass
   was launched, so that on a GPU the host work overlaps the device's. The engine runs its two
   halves apart: `compute` on a helper thread (beside the engine thread's own host work for the
   next step), `to_device` on the engine thread.
2. `mask.apply(logprobs)` (device, inside `sampler.sample`): the constrained rows' disallowed
   tokens become -inf (and the rows are renormalized when top-p needs it); the sampler draws (and
   takes the argmax) from the result. The caller keeps the unmasked logprobs: the logprob
   returned for a sampled token is the model's own, before the mask, which is what the trainer
   recomputes. On a GPU the fused sampler (`layers/triton_sampler.py`) reads the packed words
   directly instead, when no row needs top-k/top-p or top logprobs.
3. `mask.counts_to_host()` right after sampling, then `mask.forced()` (host, after the step's
   device→host sync): per batch row, whether the grammar allowed exactly one token (the token
   was forced, not chosen).
4. `advance(pairs)` (host): each matcher consumes its row's sampled token. The engine hands the
   pairs to the next step's `compute` (`consume=`), so that the helper thread does both halves of
   the grammar work while the engine thread processes the tokens and prepares the next step.

A row whose matcher is in an error state (it cannot be, unless a token was appended outside the
mask) is allowed only the stop tokens, so its sample ends instead of failing the batch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import Any

import numpy as np
import torch

from .compiler import GrammarMatcher, default_num_shards, import_llguidance

__all__ = ["GrammarMask", "MaskWorker", "PendingMasks", "ReadyMasks", "advance", "unpack_bitmask"]

log = logging.getLogger("tempering")

_bit_values_cache: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """[32] int32 on `device`: 1 << k (k = 31 wraps to INT32_MIN, which is the right bit pattern)."""
    hit = _bit_values_cache.get(device)
    if hit is None:
        hit = _bit_values_cache[device] = torch.ones(32, dtype=torch.int32, device=device) << torch.arange(32, dtype=torch.int32, device=device)
    return hit


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[C, W] int32 packed bitmask → [C, V] bool, True where the token is allowed (V <= 32 W)."""
    C, W = bits.shape
    return ((bits.unsqueeze(-1) & _bit_values(bits.device)) != 0).view(C, W * 32)[:, :vocab_size]  # [C, W, 32] → [C, V]


class GrammarMask:
    """The allowed tokens of a batch's constrained rows for one step.

    Attributes:
        rows: [C] int64 on the device: the batch rows that follow a grammar.
        bits: [C, W] int32 on the device, W = ceil(V / 32): row i's allowed-token bitmask.
        num_rows: B, the batch size.

    The number of allowed tokens per constrained row (for `forced`) is counted on the host from
    the packed words when the device is the CPU (32x fewer values than the unpacked mask), and on
    the device by `apply` otherwise (a reduction the GPU does nearly for free).
    """

    __slots__ = ("_counts_per_batch_row", "_host_rows", "_num_allowed", "bits", "num_rows", "row_index", "rows")

    def __init__(self, rows: list[int], bits: torch.Tensor, num_rows: int, num_allowed: list[int] | None = None) -> None:
        self._host_rows = rows
        pinned = bits.device.type == "cuda"
        self.rows = torch.tensor(rows, dtype=torch.long, pin_memory=pinned).to(bits.device, non_blocking=True)
        # [B] int32: each batch row's bitmask row, -1 for a free row (the fused GPU sampler reads it)
        self.row_index = self.row_index_host(rows, num_rows, pinned).to(bits.device, non_blocking=True)
        self.bits = bits
        self.num_rows = num_rows
        self._num_allowed: torch.Tensor | list[int] | None = num_allowed
        self._counts_per_batch_row = False

    @classmethod
    def sampled(cls, rows: list[int], num_rows: int, num_allowed: torch.Tensor) -> GrammarMask:
        """The record of a step that a CUDA graph sampled under its masks (`DecodeGraphs.sample_masked`):
        the constrained rows and the allowed-token counts of every batch row [B] (for `forced`)."""
        mask = object.__new__(cls)
        mask._host_rows, mask.num_rows, mask._num_allowed = rows, num_rows, num_allowed
        mask.rows = mask.row_index = mask.bits = None
        mask._counts_per_batch_row = True
        return mask

    @staticmethod
    def row_index_host(rows: list[int], num_rows: int, pinned: bool) -> torch.Tensor:
        """[B] int32 on the host: each batch row's bitmask row, -1 for a free row."""
        index = [-1] * num_rows
        for i, row in enumerate(rows):
            index[row] = i
        return torch.tensor(index, dtype=torch.int32, pin_memory=pinned)

    def set_num_allowed(self, per_batch_row: torch.Tensor) -> None:
        """Allowed-token counts [B] computed by the fused sampler (free rows ignored)."""
        self._num_allowed = per_batch_row.index_select(0, self.rows)

    @classmethod
    def fill(cls, matchers: list[GrammarMatcher | None], device: torch.device) -> GrammarMask | None:
        """The masks of one step's rows (`matchers[i]` is row i's matcher, None for a free row).

        Returns:
            None when no row follows a grammar (free batches pay nothing), else the mask, with
            its bitmask on its way to `device`.
        """
        return cls.to_device(cls.compute(matchers, pinned=device.type == "cuda"), len(matchers), device)

    @staticmethod
    def compute(matchers: list[GrammarMatcher | None], *, pinned: bool = False,
                consume: list[tuple[GrammarMatcher, int]] | None = None) -> tuple[list[int], torch.Tensor] | None:
        """The host half of `fill`: (constrained rows, their [C, W] int32 bitmasks), or None if no row
        follows a grammar. Touches only these matchers and a new buffer, so `MaskWorker` runs it on
        a helper thread while the engine thread prepares the next step.

        `consume`: (matcher, token) pairs to `advance` first (the previous step's sampled tokens),
        so that the helper does both halves of a step's grammar work."""
        plan = _MaskPlan(matchers, pinned, consume)
        if plan.has_work:
            plan.run_consume(plan.compiler.executor)
            plan.run_fill(plan.compiler.executor)
        return plan.finish()

    @classmethod
    def to_device(cls, computed: tuple[list[int], torch.Tensor] | None, num_rows: int, device: torch.device) -> GrammarMask | None:
        """The mask of `compute`'s result for a batch of `num_rows` rows, its bitmask on its way to
        `device` (a non-blocking copy from pinned memory on a GPU). Call it on the thread that
        launches the device work."""
        if computed is None:
            return None
        rows, host = computed
        if device.type == "cpu":
            return cls(rows, host, num_rows, _popcount_rows(host.numpy()))
        return cls(rows, host.to(device, non_blocking=True), num_rows)  # async from pinned memory, staged if not

    def apply(self, logprobs: torch.Tensor, *, renormalize: bool = True) -> torch.Tensor:
        """`logprobs` [B, V] (float32, log-softmaxed) with each constrained row restricted to its
        allowed tokens (others -inf); free rows unchanged. A new tensor.

        Args:
            renormalize: make the constrained rows sum to 1 again (top-p needs it; drawing by
                inverse CDF and argmax do not).
        """
        B, V = logprobs.shape
        assert B == self.num_rows and self.bits.shape[1] * 32 >= V, (logprobs.shape, self.bits.shape)
        allowed = unpack_bitmask(self.bits, V)  # [C, V] bool
        if self._num_allowed is None:
            self._num_allowed = allowed.sum(-1)
        everyone = len(self._host_rows) == B
        sub = logprobs if everyone else logprobs.index_select(0, self.rows)  # [C, V]
        sub = torch.where(allowed, sub, float("-inf"))
        if renormalize:
            sub = torch.log_softmax(sub, dim=-1)  # top-p compares against the constrained mass
        return sub if everyone else logprobs.index_copy(0, self.rows, sub)

    def counts_to_host(self) -> None:
        """Start copying the allowed-token counts to pinned host memory (call after `apply` or the
        fused sampler, before recording the step's event), so that `forced` reads them after the
        step's one synchronization instead of synchronizing the device, which would also wait
        for the next step's forward queued behind this one."""
        counts = self._num_allowed
        if isinstance(counts, torch.Tensor) and counts.is_cuda:
            self._num_allowed = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True).copy_(counts, non_blocking=True)

    def forced(self) -> list[bool]:
        """Per batch row [B]: whether its grammar allowed exactly one token (call after the step's
        sync, and after `counts_to_host` on a GPU)."""
        assert self._num_allowed is not None, "apply() first"
        counts = self._num_allowed if isinstance(self._num_allowed, list) else self._num_allowed.tolist()
        out = [False] * self.num_rows
        if self._counts_per_batch_row:
            for row in self._host_rows:
                out[row] = counts[row] == 1
            return out
        for row, n in zip(self._host_rows, counts):
            out[row] = n == 1
        return out


class _MaskPlan:
    """A step's grammar work as two llguidance argument lists, rows grouped by the copy of their
    grammar (`GrammarMatcher.shard`: a pool's contiguous chunks then keep a thread on one copy),
    and the [C, W] host buffer the masks go to."""

    def __init__(self, matchers: list[GrammarMatcher | None], pinned: bool,
                 consume: list[tuple[GrammarMatcher, int]] | None) -> None:
        self.rows = [i for i, m in enumerate(matchers) if m is not None]
        self.active = active = [matchers[i] for i in self.rows]
        self.host = None
        self.consumers: list[GrammarMatcher] = []
        self.consume: list[tuple[Any, int]] = []  # (LLMatcher, token)
        self.fill: list[tuple[Any, int]] = []  # (LLMatcher, row of the host buffer)
        first = active[0] if active else consume[0][0] if consume else None
        if first is None:
            return
        self.compiler = first.compiler
        shards = self.compiler.num_shards
        if consume:
            pairs = consume if shards == 1 else sorted(consume, key=_shard_of_pair)
            self.consumers = [m for m, _ in pairs]
            self.consume = [(m.inner, t) for m, t in pairs]
        if active:
            self.host = torch.empty((len(active), self.compiler.num_mask_words), dtype=torch.int32, pin_memory=pinned)
            order = range(len(active)) if shards == 1 else sorted(range(len(active)), key=lambda i: active[i].shard)
            self.fill = [(active[i].inner, i) for i in order]

    @property
    def has_work(self) -> bool:
        return bool(self.consume or self.fill)

    def run_consume(self, executor) -> None:
        if self.consume:
            _flag_failures(self.consumers, executor.consume_token_par(self.consume))

    def run_fill(self, executor) -> None:
        if self.fill:
            executor.unsafe_compute_mask_ptr(self.fill, self.host.data_ptr(), self.host.shape[1] * 4, self.host.shape[0])

    def finish(self) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmasks) once every job ran; rows whose matcher failed may only stop."""
        if self.host is None:
            return None
        host = self.host
        for i, m in enumerate(self.active):
            if m.failed:
                host[i] = 0
                for t in m.compiler.stop_token_ids:
                    host[i, t // 32] |= _bit(t)
        return self.rows, host


class MaskWorker:
    """A helper thread that does a step's grammar work (`GrammarMask.compute`) while the engine
    thread does the rest of its host work (processing tokens, scheduling, preparing the next
    step's inputs).

    The work is two llguidance calls, each over every row of the step: consume the previous
    step's tokens, then fill the masks. llguidance runs each call on its own pool of
    `num_threads` threads, without the GIL. The rows are grouped by the copy of their grammar
    they came from (`GrammarMatcher.shard`), so that the pool's contiguous chunks mostly keep a
    thread on one copy: llguidance 1.9 serializes the matchers of one copy. On an H100 host, 256
    rows of RULER's schema took 2.6-2.7 ms per step this way, as with one Python thread per copy
    and less GIL traffic, against 4.2-4.5 ms on one thread (`python
    benchmarks/structured_outputs.py threads`: `pool_over_copies`).

    A thread needs the GIL to get into a call and again when it returns, and a thread waiting for
    the GIL while another runs Python waits up to the interpreter's switch interval (5 ms), longer
    than the work. So the helper enters its calls where the engine thread does not hold the GIL:
    1. `submit` returns once the helper is inside its consume call (a short wait);
    2. the engine thread runs Python meanwhile (processing the tokens, scheduling), then calls
       `PendingMasks.wait_filling`, which returns once the helper is inside its fill call
       (immediately when the consume took less than that Python work);
    3. the fill runs beside the engine thread's next Python work (preparing the next step), and
       `PendingMasks.result` waits for it.

    Args:
        num_threads: llguidance's threads per call (default: `default_num_shards()`, one per copy
            of a grammar).
    """

    def __init__(self, num_threads: int | None = None) -> None:
        self.num_threads = num_threads if num_threads is not None else default_num_shards()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tempering-grammar", daemon=True)
        self._thread.start()

    def submit(self, matchers: list[GrammarMatcher | None], *, pinned: bool,
               consume: list[tuple[GrammarMatcher, int]] | None = None) -> PendingMasks:
        """Start consuming `consume`, then computing the masks of `matchers` (see
        `GrammarMask.compute`); returns once the helper is inside its consume call. The engine
        thread must not touch these matchers until the result is read."""
        plan = _MaskPlan(matchers, pinned, consume)
        pending = PendingMasks(plan)
        if plan.has_work:
            pending.future, pending.filling = concurrent.futures.Future(), threading.Event()
            consuming = threading.Event()
            self._jobs.put((plan, pending.future, consuming, pending.filling))
            consuming.wait()
        return pending

    def close(self) -> None:
        """Stop the helper once its current job is done (waits up to 60 s for it)."""
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        executor = None
        while (item := self._jobs.get()) is not None:
            job, future, consuming, filling = item
            try:
                if executor is None:
                    executor = import_llguidance().LLExecutor(num_threads=self.num_threads)
                consuming.set()
                job.run_consume(executor)
                filling.set()
                job.run_fill(executor)
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine thread, which fails the step
                future.set_exception(exc)
            finally:
                consuming.set()
                filling.set()


class PendingMasks:
    """A step's masks being computed by `MaskWorker`."""

    def __init__(self, plan: _MaskPlan) -> None:
        self.plan = plan
        self.future: concurrent.futures.Future | None = None  # None: the step had no grammar work
        self.filling: threading.Event | None = None

    @property
    def rows(self) -> list[int]:
        """The batch rows that follow a grammar (known before the masks are filled)."""
        return self.plan.rows

    def wait_filling(self) -> None:
        """Block (the GIL free) until the helper has consumed the tokens and entered its fill
        call, so that the fill runs beside this thread's next Python work (see `MaskWorker`)."""
        if self.filling is not None:
            self.filling.wait()

    def result(self) -> tuple[list[int], torch.Tensor] | None:
        """`GrammarMask.compute`'s result. Raises what the helper raised."""
        self.wait_filling()
        if self.future is not None:
            self.future.result()
        return self.plan.finish()


class ReadyMasks:
    """`GrammarMask.compute`'s result, computed on the calling thread, behind `PendingMasks`' interface."""

    def __init__(self, computed: tuple[list[int], torch.Tensor] | None) -> None:
        self.computed = computed
        self.rows = computed[0] if computed is not None else []

    def wait_filling(self) -> None:
        pass

    def result(self) -> tuple[list[int], torch.Tensor] | None:
        return self.computed


def advance(pairs: list[tuple[GrammarMatcher, int]]) -> None:
    """Each matcher consumes its sampled token (one llguidance call, without the GIL).

    A token the grammar does not allow leaves its matcher in an error state (`failed`, logged;
    the next `fill` then ends that sample); it never raises.
    """
    if not pairs:
        return
    executor = pairs[0][0].compiler.executor
    _flag_failures([m for m, _ in pairs], executor.consume_token_par([(m.inner, t) for m, t in pairs]))


def _shard_of_pair(pair: tuple[GrammarMatcher, int]) -> int:
    return pair[0].shard


def _flag_failures(matchers: list[GrammarMatcher], accepted: list[bool]) -> None:
    """Mark the matchers whose token llguidance's `consume_token_par` rejected."""
    if not all(accepted):
        for m, ok in zip(matchers, accepted):
            if not ok:
                m.mark_failed()


def _popcount_rows(bits: np.ndarray) -> list[int]:
    """Set bits per row of a [C, W] int32 array."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(bits.view(np.uint32)).sum(axis=1).tolist()
    return np.unpackbits(bits.view(np.uint8), axis=1).sum(axis=1).tolist()


def _bit(token_id: int) -> int:
    """The int32 value of token_id's bit in its word (two's complement for bit 31)."""
    b = 1 << (token_id % 32)
    return b - (1 << 32) if b >= 1 << 31 else b
