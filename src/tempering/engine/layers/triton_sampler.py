"""Sampling and the sampled token's logprob in one read of the logits (Triton, CUDA only).

Gumbel-max: `argmax_v (x_v + g_v)`, with x = logits / T and g_v = -log(-log u_v) for uniform
u_v, is an exact sample of softmax(x) (Gumbel 1954; the "exponential race" vLLM and nano-vllm
use). Here u_v is a counter-based hash of (row seed, token index in the sample, vocabulary id)
on a grid of 2^23 values in (0, 1) (sampler.gumbel_noise gives the mapping and why),
so a seeded row draws the same token whatever shares its batch, with no generator state and no
host sync. The logprob is `x_tok - logsumexp(x)` (T = 1 for greedy rows, which take the argmax
of x): the row's distribution before any mask, the one the trainer recomputes.

Pass 1, grid (rows, vocabulary chunks): each chunk's max, sum of exp(x - max) and best
(score, id). Pass 2, one program per row: merges the chunks. The logits are read once, in
their own dtype; nothing of size [rows, V] is written. `gumbel_sample_reference` (sampler.py)
is the PyTorch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gumbel_sample"]

CHUNK = 4096


@triton.jit
def _mix32(h):
    """murmur3's 32-bit finalizer on uint32 values (native 32-bit products, which wrap)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _chunk_kernel(Logits, Temperature, Seeds, Counters, PartMax, PartSum, PartScore, PartIdx,
                  MaskIndex, MaskBits, PartAllowed, stride_mask,
                  V, stride_l, num_chunks, CHUNK_SIZE: tl.constexpr, HAS_MASK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    valid = cols < V
    temperature = tl.load(Temperature + row)
    greedy = temperature <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
    x = tl.load(Logits + row * stride_l + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
    m = tl.max(x, 0)
    s = tl.sum(tl.where(valid, tl.exp(x - m), 0.0), 0)
    seed = tl.load(Seeds + row).to(tl.uint32)  # the low 32 bits, as the PyTorch twin's `& 0xFFFFFFFF`
    counter = tl.load(Counters + row).to(tl.uint32)
    h = _mix32(seed ^ 0x9E3779B9)
    h = _mix32(h ^ counter)
    h = _mix32(h ^ cols.to(tl.uint32))
    # u = (k + 0.5) / 2^23 from the hash's top 23 bits: exact in float32 and never 1 (from all 32
    # bits, float32 rounding made u = 1 for 128 hashes in 2^32, an infinite Gumbel that drew a
    # uniformly random token in ~0.45% of the rows of a 152k vocabulary); -log u kept above
    # 2^-24, its value at the largest u, wherever log rounds near 1 (`gumbel_noise` is the twin)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    gumbel = -tl.log(tl.maximum(-tl.log(u), 5.960464477539063e-08))
    score = tl.where(greedy, x, x + gumbel)
    score = tl.where(valid, score, float("-inf"))
    out = row * num_chunks + chunk
    if HAS_MASK:  # structured outputs: draw among the grammar's allowed tokens (m and s stay unmasked)
        mask_row = tl.load(MaskIndex + row)
        if mask_row >= 0:
            words = tl.load(MaskBits + mask_row * stride_mask + cols // 32, mask=valid, other=0)
            allowed = ((words >> (cols % 32)) & 1) != 0
            score = tl.where(allowed, score, float("-inf"))
            tl.store(PartAllowed + out, tl.sum(allowed.to(tl.int32), 0))
    best = tl.max(score, 0)
    best_idx = tl.min(tl.where(score == best, cols, V), 0)  # lowest id among ties, like argmax
    tl.store(PartMax + out, m)
    tl.store(PartSum + out, s)
    tl.store(PartScore + out, best)
    tl.store(PartIdx + out, best_idx)


@triton.jit
def _merge_kernel(Logits, Temperature, PartMax, PartSum, PartScore, PartIdx, TokenIds, Logprobs,
                  PartAllowed, NumAllowed, Given, stride_l, num_chunks, C_PAD: tl.constexpr, HAS_MASK: tl.constexpr,
                  HAS_GIVEN: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, C_PAD)
    valid = c < num_chunks
    base = row * num_chunks + c
    m = tl.load(PartMax + base, mask=valid, other=float("-inf"))
    s = tl.load(PartSum + base, mask=valid, other=0.0)
    score = tl.load(PartScore + base, mask=valid, other=float("-inf"))
    idx = tl.load(PartIdx + base, mask=valid, other=2147483647)
    big = tl.max(m, 0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), 0))
    if HAS_GIVEN:  # the logprob of a token chosen elsewhere, by the same arithmetic as a drawn one's
        token = tl.load(Given + row).to(tl.int32)
    else:
        best = tl.max(score, 0)
        token = tl.min(tl.where(score == best, idx, 2147483647), 0)
    temperature = tl.load(Temperature + row)
    inv_t = tl.where(temperature <= 0.0, 1.0, 1.0 / tl.where(temperature <= 0.0, 1.0, temperature))
    x_tok = tl.load(Logits + row * stride_l + token).to(tl.float32) * inv_t
    tl.store(TokenIds + row, token.to(tl.int64))
    tl.store(Logprobs + row, x_tok - lse)
    if HAS_MASK:
        tl.store(NumAllowed + row, tl.sum(tl.load(PartAllowed + base, mask=valid, other=0), 0))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  mask_bits: torch.Tensor | None = None, mask_index: torch.Tensor | None = None, *,
                  given: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One token per row by Gumbel-max, and its logprob.

    Args:
        logits: [B, V] (any float dtype, last dim contiguous).
        temperature: [B] float32; <= 0 means greedy.
        seeds, counters: [B] int64, the row's random stream and the index of the token drawn.
        mask_bits: [C, ceil(V/32)] int32 allowed-token bitmasks (bit v % 32 of word v // 32), or None.
        mask_index: [B] int32, each row's bitmask row (-1: the row is free).
        given: [B] int64 tokens whose logprobs to return instead of drawing (token_ids is then
            `given`): the same reduction as a drawn token's, so a row's logprob is bitwise the one
            its sampling returned (Engine.score).

    Returns:
        (token_ids [B] int64, logprobs [B] float32 under the unmasked distribution, and with a
        mask the number of allowed tokens per row [B] int32 (0 for free rows)).
    """
    B, V = logits.shape
    num_chunks = triton.cdiv(V, CHUNK)
    parts = torch.empty(4, B, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(B, num_chunks, dtype=torch.int32, device=logits.device)
    token_ids = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    has_mask = mask_bits is not None
    if has_mask:
        part_allowed = torch.zeros(B, num_chunks, dtype=torch.int32, device=logits.device)
        num_allowed = torch.empty(B, dtype=torch.int32, device=logits.device)
    else:
        mask_bits = mask_index = part_allowed = num_allowed = part_idx  # unused
    _chunk_kernel[(B, num_chunks)](logits, temperature, seeds, counters, parts[0], parts[1], parts[2], part_idx,
                                   mask_index, mask_bits, part_allowed, mask_bits.stride(0),
                                   V, logits.stride(0), num_chunks, CHUNK_SIZE=CHUNK, HAS_MASK=has_mask, num_warps=8)
    _merge_kernel[(B,)](logits, temperature, parts[0], parts[1], parts[2], part_idx, token_ids, logprobs,
                        part_allowed, num_allowed, given if given is not None else token_ids, logits.stride(0),
                        num_chunks, C_PAD=max(16, triton.next_power_of_2(num_chunks)), HAS_MASK=has_mask,
                        HAS_GIVEN=given is not None)
    return (token_ids if given is None else given), logprobs, num_allowed if has_mask else None
