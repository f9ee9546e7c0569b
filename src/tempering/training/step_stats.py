"""A training step's statistics: summed on the device while the step runs, read once at its end.

The objective (objective.py) returns, for each packed row, a float vector of the `STATS` sums
(loss, trained tokens, entropy, clipped tokens, importance ratios, mismatch histogram, ...).
`StepTotals` adds them up without a host read, so the GPU never waits for the host mid-step;
`rl_step_metrics` turns the totals into the step's metrics (`loss/*`, `offpolicy/*`, `data/*`,
`time/*`, `throughput/*`), the names written to history.jsonl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..types import TrainConfig
from .objective import STATS, histogram_quantile

__all__ = ["RATIO_MAX_INDEX", "StepMetrics", "StepTotals", "combine_stats", "rl_step_metrics"]

# the one statistic that is a maximum, not a sum
RATIO_MAX_INDEX = STATS.index("ratio_max")


@dataclass(slots=True)
class StepMetrics:
    """What a training step reports: metric name → value (floats, ready for history.jsonl)."""

    values: dict[str, float]


def combine_stats(total: torch.Tensor | None, stats: torch.Tensor,
                  max_index: int | None = RATIO_MAX_INDEX) -> torch.Tensor:
    """`total + stats` for statistics vectors [num_stats] (entry `max_index`: the max), on the
    device; None + stats is a copy."""
    if total is None:
        return stats.clone()
    out = total + stats
    if max_index is not None:
        out[max_index] = torch.maximum(total[max_index], stats[max_index])  # no host value reaches the device
    return out


@dataclass(slots=True)
class StepTotals:
    """A step's statistics: device-side sums of the objective's STATS vectors, read at the end."""

    sums: torch.Tensor | None = None  # [len(STATS)] over the whole step
    first_update: torch.Tensor | None = None  # the same over the first update (mismatch before any change)
    tokens: int = 0
    grad_norms: list[float] = field(default_factory=list)  # of the updates taken
    num_skipped: int = 0  # updates skipped for a non-finite gradient norm
    _read: dict[str, float] | None = None

    def add(self, stats: torch.Tensor) -> None:
        """Add one update's statistics (before its grad norm is appended)."""
        self.sums = combine_stats(self.sums, stats)
        if not self.grad_norms and not self.num_skipped:
            self.first_update = combine_stats(self.first_update, stats)

    def values(self) -> dict[str, float]:
        """The sums as floats (reads the device once; call after the last `add`)."""
        if self._read is not None:
            return self._read
        zeros = [0.0] * len(STATS)
        sums = dict(zip(STATS, self.sums.tolist() if self.sums is not None else zeros))
        first = dict(zip(STATS, self.first_update.tolist() if self.first_update is not None else zeros))
        self._read = {**sums, "first_trained": first["trained"], "first_mismatch_abs": first["mismatch_abs"],
                      "first_mismatch_k3": first["mismatch_k3"], "first_bitwise_equal": first["bitwise_equal"],
                      "first_mismatch_p99": histogram_quantile([first[k] for k in STATS if k.startswith("mismatch_hist_")],
                                                               0.99)}
        return self._read


def rl_step_metrics(totals: StepTotals, config: TrainConfig, elapsed: float, *,
                    shared_rows: tuple[int, int] | None = None, num_rescored: int | None = None,
                    rescore_s: float = 0.0) -> dict[str, float]:
    """An RL step's metrics from its totals (the step's one read of device values).

    Args:
        elapsed: the step's wall-clock seconds.
        shared_rows: with work sharing, (the update's micro-batches, those computed on this rank).
        num_rescored: with exact on-policy training, the trained tokens the engine rescored.
        rescore_s: the seconds spent rescoring (within `elapsed`).
    """
    t = totals.values()
    n = max(t["trained"], 1)
    updates = max(len(totals.grad_norms) + totals.num_skipped, 1)
    metrics = {
        "loss/train": t["loss"] / updates,
        "loss/grad_norm": sum(totals.grad_norms) / len(totals.grad_norms) if totals.grad_norms else math.nan,
        "loss/grad_norm_max": max(totals.grad_norms, default=math.nan),
        "loss/num_updates_skipped": float(totals.num_skipped),
        "loss/entropy": t["entropy"] / n,
        "loss/learning_rate": config.learning_rate,
        "loss/clip_fraction": t["clipped"] / n,
        "offpolicy/ratio_mean": t["ratio_sum"] / n,
        "offpolicy/ratio_max": t["ratio_max"],
        "data/step_trainer_tokens": float(totals.tokens),
        "data/step_completion_tokens": t["trained"],
        "data/step_num_optimizer_updates": float(len(totals.grad_norms)),  # taken
        "time/step_trainer_s": elapsed,
        "throughput/trainer_tok_per_s": totals.tokens / elapsed if elapsed > 0 else 0.0,
    }
    if shared_rows is not None:  # work sharing: the micro-batches the serving ranks computed
        metrics["data/step_micro_batches"] = float(shared_rows[0])
        metrics["data/step_micro_batches_shared"] = float(shared_rows[0] - shared_rows[1])
    if t["first_trained"]:  # before any update: the engine-vs-trainer mismatch alone
        metrics["offpolicy/mismatch_abs_logprob"] = t["first_mismatch_abs"] / t["first_trained"]
        metrics["offpolicy/mismatch_kl"] = t["first_mismatch_k3"] / t["first_trained"]
        metrics["offpolicy/mismatch_abs_logprob_p99"] = t["first_mismatch_p99"]  # a histogram bin's upper edge
        metrics["offpolicy/bitwise_equal_fraction"] = t["first_bitwise_equal"] / t["first_trained"]
    if num_rescored is not None:  # exact on-policy: the share of trained tokens the engine recomputed
        metrics["offpolicy/rescored_fraction"] = num_rescored / n
        metrics["time/step_rescore_s"] = rescore_s  # within time/step_trainer_s
    if config.kl_penalty_coef > 0:
        metrics["loss/kl"] = t["kl"] / n
    if config.truncated_importance_sampling is not None:
        metrics["offpolicy/tis_capped_fraction"] = t["tis_capped"] / n
    if config.importance_ratio_mask is not None:
        metrics["offpolicy/masked_fraction"] = t["masked"] / n
    return metrics
