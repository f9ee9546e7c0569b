"""Learning check: the demo's addition task, sequential loop vs pipelined (max_staleness=1), same data.

For each seed, both variants train the default model on the same problems, in the same order
(`steps` x `groups_per_step` problems x `group_size` rollouts: the same number of trained
trajectories), with the same learning rate, and validate on the same held-out problems before
training, every `val_every` steps and after the last (the pipeline validates saved steps in the
background). The order of the two variants alternates between seeds, so a machine that gets
busier or quieter favours neither. Prints one JSON line per run and a summary line: mean
validation reward after the last step, training wall-clock (first validation done to last
validation done) and the two checks of issue 12 (pipelined reward >= sequential, in less time).

    python benchmarks/pipeline_learning.py                         # the demo's sizes, seeds 0 1 2
    python benchmarks/pipeline_learning.py --steps 2 --groups-per-step 2 --group-size 4 \\
        --num-val 8 --val-samples 1 --seeds 0                      # a quick run that shows it works

RL is noisy: three seeds of a 135M model separate the two only when the gap is large; read the
per-seed numbers too. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--num-val", type=int, default=64)
    parser.add_argument("--val-samples", type=int, default=2)
    parser.add_argument("--val-every", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--loss-fn", default="ppo", choices=["ppo", "cispo", "gspo"], help="TrainConfig.loss_fn of both variants")
    parser.add_argument("--decoupled", action=argparse.BooleanOptionalAction, default=None,
                        help="TrainConfig.decoupled for both variants (default: off for the sequential loop, "
                             "on for the pipeline, as PipelineTrainer does)")
    parser.add_argument("--variants", default="sequential,pipelined", help="run only these (comma-separated)")
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    from tempering.demo.run import run_demo_async

    hf_logging.disable_progress_bar()
    runs = []
    for i, seed in enumerate(args.seeds):
        variants = [None, args.max_staleness] if i % 2 == 0 else [args.max_staleness, None]
        for staleness in variants:
            variant = "sequential" if staleness is None else "pipelined"
            if variant not in args.variants.split(","):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                result = asyncio.run(run_demo_async(
                    path=Path(tmp), steps=args.steps, groups_per_step=args.groups_per_step, group_size=args.group_size,
                    num_val=args.num_val, val_samples=args.val_samples, learning_rate=args.learning_rate, seed=seed,
                    val_every=args.val_every, name=f"{variant}-{seed}", max_staleness=staleness,
                    train_options={"loss_fn": args.loss_fn,
                                   **({} if args.decoupled is None else {"decoupled": args.decoupled})},
                    echo=lambda _: None,
                ))
            run = {
                "variant": variant, "seed": seed, "max_staleness": staleness,
                "val_reward_before": round(result.val_reward_before, 4),
                "val_reward_after": round(result.val_rewards[max(result.val_rewards)], 4),
                "val_rewards": {str(k): round(v, 4) for k, v in sorted(result.val_rewards.items())},
                "num_trajectories_trained": result.num_trajectories_trained,
                "training_s": round(result.training_seconds, 1),
            }
            runs.append(run)
            print(json.dumps(run), flush=True)

    def mean(variant: str, key: str) -> float:
        values = [r[key] for r in runs if r["variant"] == variant]
        return statistics.mean(values) if values else float("nan")

    summary = {
        "benchmark": "pipeline_learning",
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "seeds": args.seeds,
        "steps": args.steps, "groups_per_step": args.groups_per_step, "group_size": args.group_size,
        "num_val": args.num_val, "val_samples": args.val_samples, "learning_rate": args.learning_rate,
        "loss_fn": args.loss_fn, "decoupled": args.decoupled,
        **{f"{v}_{k}": round(mean(v, k), 4) for v in ("sequential", "pipelined")
           for k in ("val_reward_before", "val_reward_after", "training_s", "num_trajectories_trained")},
    }
    summary["pipelined_reward_at_least_sequential"] = summary["pipelined_val_reward_after"] >= summary["sequential_val_reward_after"]
    summary["pipelined_faster"] = summary["pipelined_training_s"] < summary["sequential_training_s"]
    summary["time_ratio"] = round(summary["pipelined_training_s"] / summary["sequential_training_s"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
