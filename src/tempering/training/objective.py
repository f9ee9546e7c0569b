"""One packed row's RL objective: logprobs, surrogate loss, corrections and statistics, with no host sync.

`rl_objective` turns a `Row` (batching.py) into the weighted loss whose gradient the trainer
accumulates (with `row.exact_logprobs`, the logprobs' values are the engine's and their gradient
this forward's: a straight-through estimator, exact on-policy), and a vector of sums (`STATS`) that the trainer adds up over the step and reads
once at its end. Nothing here reads a value back to the host (no `.item()`, no boolean
indexing), so the same code runs eagerly and inside a captured CUDA graph (cuda_graphs.py).

Padded predictions (`row.valid` False) enter every formula with stand-in values (logprobs 0,
weight 0), so they are finite and contribute exactly zero to the loss, the gradient and the
statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..types import TrainConfig
from .batching import Row
from .losses import kl_estimate, policy_loss

__all__ = ["MISMATCH_EDGES", "STATS", "histogram_quantile", "rl_objective"]

# Upper edges (nats) of the histogram of |engine logprob − trainer logprob| per trained token:
# 10^(-5 + k/4), so 0.001, 0.01 and 0.1 are edges; a last bin takes everything above 10.
MISMATCH_EDGES = tuple(10.0 ** (-5 + k / 4) for k in range(25))

# the sums in the statistics vector, in order (ratio_max is a max, not a sum), then the histogram's counts
STATS = ("loss", "trained", "entropy", "clipped", "ratio_sum", "ratio_max", "kl", "masked", "tis_capped",
         "mismatch_abs", "mismatch_k3", "bitwise_equal") + tuple(f"mismatch_hist_{k}" for k in range(len(MISMATCH_EDGES) + 1))


DECOUPLED_WEIGHT_CAP = 2.0  # π_prox / π_sampled cap of TrainConfig.decoupled when truncated_importance_sampling is unset


def rl_objective(
    logprobs_of: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    row: Row,
    config: TrainConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's loss Σ weight × loss_token and its statistics.

    Args:
        logprobs_of: `logprobs_of(row, chunk_size, lora=...)` → (logprobs [N] float32, entropy [N]
            float32) of the row's predictions, computed `chunk_size` rows at a time (lora=False:
            under the base model).
        row: the row, on the model's device.
        config: loss, clipping, corrections and KL options (see TrainConfig).

    Returns:
        (loss: 0-dim float32 with gradient, stats: [len(STATS)] float32 detached sums over the
        row's valid predictions, in the order of STATS).
    """
    valid = row.valid
    validf = valid.float()
    logprobs, entropy = logprobs_of(row, config.logprob_chunk_size, lora=True)
    if row.exact_logprobs is not None:  # exact on-policy: the engine's own values, this forward's gradient
        logprobs = logprobs + (row.exact_logprobs - logprobs).detach()
    new = torch.where(valid, logprobs, 0.0)  # [N]; padding: a finite stand-in without gradient
    sampled = row.sampled_logprobs
    # decoupled (AReaL): the ratio and clip against the proximal policy (these weights, detached)
    behaviour = new.detach() if config.decoupled else sampled
    loss_tok, clipped, _ = policy_loss(new, behaviour, row.advantages, loss_fn=config.loss_fn, clip_low=config.clip_low,
                                       clip_high=config.clip_high, seq_index=row.seq_index, num_seqs=row.num_seqs)
    log_ratio = new.detach() - sampled  # the engine-vs-trainer log ratio per token (π_prox / π_sampled)
    token_ratio = torch.exp(log_ratio)
    zero = torch.zeros((), device=new.device)
    tis_capped = masked = kl_sum = zero
    cap = config.truncated_importance_sampling
    if cap is None and config.decoupled:
        cap = DECOUPLED_WEIGHT_CAP
    if cap is not None:
        loss_tok = loss_tok * token_ratio.clamp(max=cap)
        tis_capped = ((token_ratio > cap) & valid).sum()
    if config.importance_ratio_mask is not None:
        low, high = config.importance_ratio_mask
        keep = (token_ratio >= low) & (token_ratio <= high)
        loss_tok = loss_tok * keep
        masked = (~keep & valid).sum()
    if config.kl_penalty_coef > 0:
        with torch.no_grad():  # the base policy: the same weights with the LoRA off
            ref = torch.where(valid, logprobs_of(row, config.logprob_chunk_size, lora=False)[0], 0.0)
        kl = kl_estimate(new, ref, config.kl_estimator)
        loss_tok = loss_tok + config.kl_penalty_coef * kl
        kl_sum = (kl.detach() * validf).sum()
    loss = (loss_tok * row.weights).sum()
    stats = [
        loss.detach(),
        validf.sum(),
        (entropy * validf).sum(),
        (clipped & valid).sum(),
        (token_ratio * validf).sum(),
        (token_ratio * validf).max() if len(valid) else zero,
        kl_sum,
        masked,
        tis_capped,
        (log_ratio.abs() * validf).sum(),
        # k3 estimate of KL(engine || trainer) from the engine's samples: r - 1 - log r, r = π_trainer / π_engine
        ((torch.exp(log_ratio) - 1 - log_ratio) * validf).sum(),
        ((new.detach() == sampled) & valid).sum(),  # tokens whose trainer logprob is the sampled one, bit for bit
    ]
    # MISMATCH_EDGES made on the device (a host-to-device copy is not allowed while a CUDA graph captures)
    edges = torch.pow(10.0, torch.arange(len(MISMATCH_EDGES), dtype=torch.float32, device=new.device) / 4 - 5)
    bins = torch.bucketize(log_ratio.abs(), edges)  # [N] in 0..len(edges)
    histogram = torch.zeros(len(MISMATCH_EDGES) + 1, device=new.device).index_add_(0, bins, validf)
    return loss, torch.cat([torch.stack([v.float() for v in stats]), histogram])


def histogram_quantile(counts: list[float], q: float) -> float:
    """The upper edge of the MISMATCH_EDGES bin that holds quantile `q` of a histogram (inf past the last edge,
    nan when empty): an upper bound of the quantile, exact at the edges."""
    total = sum(counts)
    if total <= 0:
        return float("nan")
    running = 0.0
    for edge, count in zip((*MISMATCH_EDGES, float("inf")), counts):
        running += count
        if running >= q * total:
            return edge
    return float("inf")
