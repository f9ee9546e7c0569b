"""Logits → sampled token ids and their logprobs, for a batch of rows with their own options.

Sampling uses the exponential race (`argmax(p / E)`, E ~ Exp(1)), which draws exactly from `p`
like `torch.multinomial` but needs no host sync and lets each seeded row use its own generator.
The returned logprob of a token is `log_softmax(logits / T)[token]` at the row's temperature T
(T = 1 for greedy rows), before top-k/top-p truncation: the distribution the trainer recomputes,
so the on-policy importance ratio is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

__all__ = ["SampleOutput", "sample"]


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor | None  # [B, K] int64, K = the largest num_top_logprobs of the batch
    top_logprobs: torch.Tensor | None  # [B, K] float32


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SampleOutput:
    """Draw one token per row.

    Args:
        logits: [B, V] float logits of the next token.
        params: B sampling options, one per row.
        generators: B generators; a row with None draws from `default_generator`.
        default_generator: generator of the unseeded rows (torch's global one when None).

    Returns:
        SampleOutput with ids [B], logprobs [B] (natural log, float32) and, when any row asks for
        top logprobs, the K most likely ids and their logprobs [B, K].
    """
    logits = logits.float()
    B, V = logits.shape
    temperature = torch.tensor([p.logprob_temperature for p in params], dtype=torch.float32, device=logits.device)
    logprobs_all = torch.log_softmax(logits / temperature[:, None], dim=-1)  # [B, V]

    token_ids = logprobs_all.argmax(dim=-1)  # greedy rows keep this
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _truncate(logprobs_all[rows], [params[i] for i in sampled_rows]).exp_()  # [S, V]
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(sampled_rows) if generators[i] is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), V, device=logits.device).exponential_(generator=default_generator)
        for j, i in enumerate(sampled_rows):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
        token_ids[rows] = (probs / noise).argmax(dim=-1)

    logprobs = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)
    k = max(p.num_top_logprobs for p in params)
    top_ids = top_logprobs = None
    if k:
        top_logprobs, top_ids = logprobs_all.topk(k, dim=-1)
    return SampleOutput(token_ids, logprobs, top_ids, top_logprobs)


def _truncate(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf the logprobs outside each row's top-k and top-p set. logprobs: [S, V]."""
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logprobs
    out = logprobs.clone()
    sorted_lp, order = out.sort(dim=-1, descending=True)  # [S, V]
    remove = torch.zeros_like(sorted_lp, dtype=torch.bool)
    ranks = torch.arange(out.shape[-1], device=out.device)
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        if k:
            remove[row] |= ranks >= k
        if p < 1.0:
            cumulative = sorted_lp[row].exp().cumsum(-1)
            remove[row] |= (cumulative - sorted_lp[row].exp()) >= p  # keep the token that crosses p
    out.scatter_(1, order, sorted_lp.masked_fill(remove, float("-inf")))
    return out
