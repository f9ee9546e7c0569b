"""Logprobs of chosen tokens from hidden states, in chunks, never materializing all logits.

The LM head turns N hidden states into an [N, V] logits matrix (V = 49,152 for SmolLM2, 151,936
for Qwen): 8 × 256 tokens of fp32 Qwen logits are 1.2 GB, plus as much again for the softmax's
backward. Here each chunk of `chunk_size` rows computes its logits, log-softmax and the chosen
token's logprob inside `torch.utils.checkpoint`, so only one chunk's logits exist at a time, in
the forward pass and again in the backward pass (which recomputes them).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["selective_logprobs"]


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor):
    logits = (hidden @ weight.T).float() * inv_temperature[:, None]  # [n, V]
    logsumexp = torch.logsumexp(logits, dim=-1)  # [n]
    chosen = logits.gather(1, targets[:, None]).squeeze(1) - logsumexp  # [n]
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = logsumexp - (probs * logits).sum(-1)  # [n]
    return chosen, entropy


def selective_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    *,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ W.T / T)[target] for each row, and the entropy of that distribution.

    Args:
        hidden: [N, H] final hidden states (after the last norm) at the positions that predict.
        lm_head_weight: [V, H] output embedding.
        targets: [N] int64 ids whose logprobs are wanted.
        temperature: [N] float, the temperature of each row's distribution.
        chunk_size: rows per chunk; peak memory is about chunk_size × V × 4 bytes × 3.

    Returns:
        (logprobs [N] float32 with grad, entropy [N] float32 in nats, detached).
    """
    inv_temperature = (1.0 / temperature).to(torch.float32)
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        args = (hidden[start:end], lm_head_weight, targets[start:end], inv_temperature[start:end])
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprobs), torch.cat(entropies).detach()
