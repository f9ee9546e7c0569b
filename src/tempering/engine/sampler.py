"""Logits → sampled token ids and their logprobs, for a batch of rows with their own options.

Everything is batched tensor work with no host sync, so it can run on the GPU inside a step.

- Temperature T per row; T = 0 rows are greedy.
- top-k / top-p per row, applied on the sorted distribution only when a row asks for them.
- Sampling draws one uniform number per row and inverts the CDF, which samples exactly from the
  categorical distribution: first over chunks of 1024 token probabilities (float64 cumsum of the
  chunk sums), then inside the chosen chunk, so no full-vocabulary float64 cumsum is needed. The
  uniform number comes from a counter-based hash of (row seed, token index), so a seeded request
  gives the same tokens whatever else shares its batch, and rows need no generator objects.
- The returned logprob of a token is `log_softmax(logits / T)[token]` at the row's temperature
  (T = 1 for greedy rows), before top-k/top-p truncation: the distribution the trainer recomputes,
  so the on-policy importance ratio is exactly 1.
- Structured outputs: with a `GrammarMask`, constrained rows draw only among their grammar's
  allowed tokens (renormalized when top-p needs it); the returned logprobs stay the unmasked ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .grammar import GrammarMask

__all__ = ["SampleOutput", "SamplingTensors", "gumbel_noise", "gumbel_sample_reference", "hash_uniform", "sample",
           "token_logprobs"]

_MASK32 = 0xFFFFFFFF

try:  # the fused GPU sampler needs Triton, which CPU builds of torch do not bring
    from .layers.triton_sampler import gumbel_sample
except ImportError:  # pragma: no cover - depends on the installation
    gumbel_sample = None


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling options as tensors on the logits' device.

    Attributes:
        temperature: [B] float32; 0 means greedy.
        top_k: [B] int64; 0 means off.
        top_p: [B] float32; 1 means off.
        seeds: [B] int64 in [0, 2^31), the row's random stream.
        counters: [B] int64, the index of the token being drawn (the stream position).
        needs_truncation: whether any row has top-k or top-p on (host-side flag).
        num_top_logprobs: largest number of top logprobs any row asks for.
        has_greedy, has_sampled: whether some rows are greedy, some sampled (host-side flags).
        unit_temperature: every row samples at temperature 1 or is greedy (no division needed).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor
    needs_truncation: bool
    num_top_logprobs: int
    has_greedy: bool = True
    has_sampled: bool = True
    unit_temperature: bool = False


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor | None  # [B, K] int64
    top_logprobs: torch.Tensor | None  # [B, K] float32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32  # int64 products wrap; the low 32 bits are exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(h: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from 32-bit hashes (int64 tensor of values in [0, 2^32)), float32, same shape.

    g = -log(-log u) with u = (k + 0.5) / 2^23, k the hash's top 23 bits: every u is exact in
    float32 and lies in [2^-24, 1 - 2^-24], so g is finite (within [-2.8, 16.7]). Mapping all 32
    bits to float32 would round 128 hashes in 2^32 to u = 1 and g = +inf: that token wins whatever
    its probability, which in a 152k vocabulary replaced ~0.45% of the draws by a uniformly
    random token. -log u is kept above 2^-24 (its exact value at the largest u) in case a fast
    log rounds it to 0. The fused GPU sampler computes the same.
    """
    u = ((h >> 9).float() + 0.5) * 2.0 ** -23
    return -torch.log((-torch.log(u)).clamp_min(2.0 ** -24))


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) per row, a pure function of (seed, counter). Shapes: [B] → [B] float64."""
    h = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ (counters & _MASK32))
    h = _mix32((h + 0x7F4A7C15) & _MASK32)
    return (h.double() + 0.5) / 4294967296.0


def sample(logits: torch.Tensor, options: SamplingTensors, grammar_mask: GrammarMask | None = None, *,
           exact_logprobs: bool = False) -> SampleOutput:
    """Draw one token per row.

    Args:
        logits: [B, V] logits of the next token (any float dtype).
        options: per-row options (see SamplingTensors).
        grammar_mask: the allowed tokens of the rows that follow a grammar (structured outputs),
            or None; it restricts what is drawn, not the logprobs returned.
        exact_logprobs: (CUDA) return every row's logprob as `token_logprobs` computes it (the fused
            sampler's arithmetic, whatever drew the token), so that scoring the same logits gives
            the same bits (the engine's batch-invariant mode).

    Returns:
        SampleOutput: ids [B], their logprobs [B] (natural log, float32) and, when a row asks
        for them, the K most likely ids and logprobs [B, K] under the same distribution.
    """
    if logits.is_cuda and gumbel_sample is not None and not options.needs_truncation and not options.num_top_logprobs:
        if grammar_mask is None:
            token_ids, logprobs, _ = gumbel_sample(logits, options.temperature, options.seeds, options.counters)
        else:  # the fused kernel reads the packed bitmasks and counts each row's allowed tokens
            token_ids, logprobs, num_allowed = gumbel_sample(logits, options.temperature, options.seeds, options.counters,
                                                             grammar_mask.bits, grammar_mask.row_index)
            grammar_mask.set_num_allowed(num_allowed)
        return SampleOutput(token_ids, logprobs, None, None)
    if options.unit_temperature:  # one pass: read the logits, write float32 logprobs
        logprobs_all = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [B, V]
    else:
        greedy = options.temperature <= 0
        temperature = torch.where(greedy, torch.ones_like(options.temperature), options.temperature)
        logprobs_all = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    # structured outputs: draw among the grammar's tokens; the logprobs returned stay the model's own
    drawable = logprobs_all if grammar_mask is None else grammar_mask.apply(logprobs_all, renormalize=options.needs_truncation)

    token_ids = None
    if options.has_sampled:
        u = hash_uniform(options.seeds, options.counters)
        if options.needs_truncation:
            sorted_lp, order = drawable.sort(dim=-1, descending=True)  # [B, V]
            probs = sorted_lp.exp()
            ranks = torch.arange(probs.shape[-1], device=probs.device)
            remove = (options.top_k[:, None] > 0) & (ranks[None, :] >= options.top_k[:, None])
            remove |= (probs.cumsum(-1) - probs) >= options.top_p[:, None]  # keep the token crossing top_p
            remove[:, 0] = False  # and always the most likely one (top_p = 0, or one that rounds to 0 in float32)
            drawn = order.gather(1, _invert_cdf(sorted_lp.masked_fill(remove, float("-inf")), u)[:, None])[:, 0]
        else:
            drawn = _invert_cdf(drawable, u)
        token_ids = drawn
    if options.has_greedy:
        best = drawable.argmax(dim=-1)
        token_ids = best if token_ids is None else torch.where(options.temperature <= 0, best, token_ids)

    logprobs = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)
    if exact_logprobs and logits.is_cuda and gumbel_sample is not None:
        logprobs = token_logprobs(logits, options.temperature, token_ids)
    top_ids = top_logprobs = None
    if options.num_top_logprobs:
        top_logprobs, top_ids = logprobs_all.topk(options.num_top_logprobs, dim=-1)
    return SampleOutput(token_ids, logprobs, top_ids, top_logprobs)


def token_logprobs(logits: torch.Tensor, temperature: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T)[token] per row (T <= 0: at T = 1), by the fused sampler's own
    reduction on CUDA (each row alone: batch-invariant), else by PyTorch.

    Args:
        logits: [B, V]; temperature: [B] float32; token_ids: [B] int64.

    Returns:
        [B] float32.
    """
    if logits.is_cuda and gumbel_sample is not None:
        zeros = torch.zeros_like(token_ids)
        return gumbel_sample(logits, temperature.float(), zeros, zeros, given=token_ids)[1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    return torch.log_softmax(logits.float() / t[:, None], dim=-1).gather(1, token_ids[:, None]).squeeze(1)


_CHUNK = 1024


def _invert_cdf(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j per row where u * total mass falls in the CDF of exp(logprobs) ([B, V], -inf = excluded; u: [B]).

    Two levels, so that nothing of size V is summed in float64: the mass of each chunk of
    `_CHUNK` tokens (a log-sum-exp), then the cumulative sum inside the chosen chunk.
    """
    B, V = logprobs.shape
    full = V // _CHUNK
    parts = []
    if full:
        parts.append(logprobs[:, : full * _CHUNK].view(B, full, _CHUNK).logsumexp(-1))
    if V % _CHUNK:
        parts.append(logprobs[:, full * _CHUNK:].logsumexp(-1, keepdim=True))
    chunk_lse = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [B, C]
    C = chunk_lse.shape[1]
    chunk_cdf = chunk_lse.double().exp().cumsum(-1)  # [B, C]
    tiny = torch.finfo(torch.float64).tiny
    # the first chunk (then token) whose CDF reaches the target, the target kept in (0, total]: the
    # pick then always has mass, also where the chunk masses (float32 log-sum-exps) and the sums
    # inside a chunk (float64) round apart; an excluded (-inf) token is never drawn
    target = (u * chunk_cdf[:, -1])[:, None].clamp(min=tiny)  # [B, 1] float64
    chunk = torch.searchsorted(chunk_cdf, target).clamp_(max=C - 1)  # [B, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(target))
    index = chunk * _CHUNK + torch.arange(_CHUNK, device=logprobs.device)  # [B, CHUNK]
    inside = logprobs.gather(1, index.clamp(max=V - 1)).masked_fill(index >= V, float("-inf"))
    inner = inside.double().exp().cumsum(-1)
    offset = torch.searchsorted(inner, torch.minimum(target - before, inner[:, -1:]).clamp(min=tiny))
    return (chunk * _CHUNK + offset.clamp_(max=_CHUNK - 1)).squeeze(1)


def gumbel_sample_reference(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                            counters: torch.Tensor, allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch twin of the fused GPU sampler (`layers/triton_sampler.py`): Gumbel-max.

    token = argmax_v(x_v + g_v) with x = logits / T and g_v = -log(-log u_v), u_v a hash of
    (seed, counter, v), which is an exact sample of softmax(x); greedy rows (T <= 0) take
    argmax x. Returns (token_ids [B] int64, logprobs [B] float32 = x_tok - logsumexp(x), T = 1
    for greedy rows). `allowed` [B, V] bool restricts the draw (structured outputs), not the
    logprob. Used on the GPU through its Triton twin; the CPU engine samples with `sample`'s
    inverse CDF, which needs no per-token hash.
    """
    greedy = temperature <= 0
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / torch.where(greedy, torch.ones_like(temperature), temperature))
    x = logits.float() * inv_t[:, None]  # [B, V]
    h = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ (counters & _MASK32))
    cols = torch.arange(x.shape[1], device=x.device)
    h = _mix32(h[:, None] ^ cols[None, :])  # [B, V]
    score = torch.where(greedy[:, None], x, x + gumbel_noise(h))
    if allowed is not None:
        score = score.masked_fill(~allowed, float("-inf"))
    token_ids = score.argmax(dim=-1)
    logprobs = x.gather(1, token_ids[:, None])[:, 0] - x.logsumexp(dim=-1)
    return token_ids, logprobs


def sampling_tensors(params: list, seeds: list[int], counters: list[int], device: torch.device | None = None,
                     *, to_device=None) -> SamplingTensors:
    """Build SamplingTensors from per-row SamplingParams, seeds and token counters.

    `to_device(values, dtype)` moves a host list to the device (default: `torch.tensor(..., device=device)`).
    """
    if to_device is None:
        def to_device(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)
    return SamplingTensors(
        temperature=to_device([p.temperature for p in params], torch.float32),
        top_k=to_device([max(p.top_k, 0) for p in params], torch.int64),
        top_p=to_device([p.top_p for p in params], torch.float32),
        seeds=to_device(seeds, torch.int64),
        counters=to_device(counters, torch.int64),
        **sampling_flags(params),
    )


def sampling_flags(params: list) -> dict:
    """The host-side flags of SamplingTensors for these rows' SamplingParams."""
    return dict(
        needs_truncation=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        num_top_logprobs=max((p.num_top_logprobs for p in params), default=0),
        has_greedy=any(p.temperature <= 0 for p in params),
        has_sampled=any(p.temperature > 0 for p in params),
        unit_temperature=all(p.temperature in (0.0, 1.0) for p in params),
    )
