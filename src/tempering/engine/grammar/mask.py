"""One step's allowed tokens for the rows of a batch that follow a grammar, and the step after.

Per step, in this order:
1. `GrammarMask.fill(matchers, device)` (host): llguidance's thread pool writes each constrained
   row's allowed-token bitmask (bit t % 32 of int32 word t // 32 set = token t allowed) into a
   pinned buffer, which is copied to the device without blocking. Call it after the forward pass
   was launched, so that on a GPU the host work overlaps the device's.
2. `mask.apply(logprobs)` (device, inside `sampler.sample`): the constrained rows' disallowed
   tokens become -inf and those rows are renormalized; the sampler draws (and takes the argmax)
   from the result. The caller keeps the unmasked logprobs: the logprob returned for a sampled
   token is the model's own, before the mask, which is what the trainer recomputes.
3. `mask.forced()` (host, after the step's device→host sync): per batch row, whether the grammar
   allowed exactly one token (the token was forced, not chosen).
4. `advance(pairs)` (host): each matcher consumes its row's sampled token.

A row whose matcher is in an error state (it cannot be, unless a token was appended outside the
mask) is allowed only the stop tokens, so its sample ends instead of failing the batch.
"""

from __future__ import annotations

import logging

import torch

from .compiler import GrammarMatcher

__all__ = ["GrammarMask", "advance"]

log = logging.getLogger("tempering")

_unpack_cache: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _unpack_indices(device: torch.device, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([V] int64 word index t // 32, [V] int32 bit value 1 << (t % 32)) on `device` (cached)."""
    key = (device, vocab_size)
    hit = _unpack_cache.get(key)
    if hit is None:
        t = torch.arange(vocab_size, device=device)
        bit = torch.ones((), dtype=torch.int32, device=device) << (t % 32).to(torch.int32)  # 1 << 31 wraps to INT32_MIN
        hit = _unpack_cache[key] = (t // 32, bit)
    return hit


class GrammarMask:
    """The allowed tokens of a batch's constrained rows for one step.

    Attributes:
        rows: [C] int64 on the device: the batch rows that follow a grammar.
        bits: [C, W] int32 on the device, W = ceil(V / 32): row i's allowed-token bitmask.
        num_rows: B, the batch size.
        num_allowed: [C] int64 on the device once `apply` ran: allowed tokens per constrained row.
    """

    __slots__ = ("_host_rows", "bits", "num_allowed", "num_rows", "rows")

    def __init__(self, rows: list[int], bits: torch.Tensor, num_rows: int) -> None:
        self._host_rows = rows
        self.rows = torch.tensor(rows, dtype=torch.long).to(bits.device, non_blocking=True)
        self.bits = bits
        self.num_rows = num_rows
        self.num_allowed: torch.Tensor | None = None

    @classmethod
    def fill(cls, matchers: list[GrammarMatcher | None], device: torch.device) -> GrammarMask | None:
        """The masks of one step's rows (`matchers[i]` is row i's matcher, None for a free row).

        Returns:
            None when no row follows a grammar (free batches pay nothing), else the mask, with
            its bitmask on its way to `device`.
        """
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        active = [matchers[i] for i in rows]
        compiler = active[0].compiler
        pinned = device.type == "cuda"
        host = torch.empty((len(rows), compiler.num_mask_words), dtype=torch.int32, pin_memory=pinned)  # [C, W]
        import llguidance.torch as llt

        llt.fill_next_token_bitmask_par(compiler.executor, [(m.inner, i) for i, m in enumerate(active)], host)
        for i, m in enumerate(active):
            if m.is_error:
                log.warning("a grammar-constrained sample hit a parser error and is ended: %s", m.error[:500])
                host[i] = 0
                for t in compiler.stop_token_ids:
                    host[i, t // 32] |= _bit(t)
        return cls(rows, host.to(device, non_blocking=pinned), len(matchers))

    def apply(self, logprobs: torch.Tensor) -> torch.Tensor:
        """`logprobs` [B, V] (float32, log-softmaxed) with each constrained row restricted to its
        allowed tokens (others -inf) and renormalized; free rows unchanged. A new tensor.

        Also sets `num_allowed`.
        """
        B, V = logprobs.shape
        assert B == self.num_rows and self.bits.shape[1] * 32 >= V, (logprobs.shape, self.bits.shape)
        words, bit = _unpack_indices(logprobs.device, V)
        allowed = (self.bits.index_select(1, words) & bit) != 0  # [C, V] bool
        self.num_allowed = allowed.sum(-1)
        everyone = len(self._host_rows) == B
        sub = logprobs if everyone else logprobs.index_select(0, self.rows)  # [C, V]
        sub = sub.masked_fill(~allowed, float("-inf"))
        sub = sub - sub.logsumexp(-1, keepdim=True)  # top-p compares against the constrained mass
        return sub if everyone else logprobs.index_copy(0, self.rows, sub)

    def forced(self) -> list[bool]:
        """Per batch row [B]: whether its grammar allowed exactly one token (call after `apply`;
        reads a [C] tensor from the device, so call it after the step's sync)."""
        assert self.num_allowed is not None, "apply() first"
        out = [False] * self.num_rows
        for row, n in zip(self._host_rows, self.num_allowed.tolist()):
            out[row] = n == 1
        return out


def advance(pairs: list[tuple[GrammarMatcher, int]]) -> None:
    """Each matcher consumes its sampled token (in llguidance's thread pool).

    A token the grammar does not allow leaves its matcher in an error state (logged at the next
    `fill`, which then ends that sample); it never raises.
    """
    if not pairs:
        return
    executor = pairs[0][0].compiler.executor
    executor.consume_token_par([(m.inner, t) for m, t in pairs])


def _bit(token_id: int) -> int:
    """The int32 value of token_id's bit in its word (two's complement for bit 31)."""
    b = 1 << (token_id % 32)
    return b - (1 << 32) if b >= 1 << 31 else b
