"""Train SmolLM2-135M-Instruct to play tic-tac-toe against a random opponent (CPU is enough).

    python examples/tic_tac_toe/train.py [--steps 10] [--seed 0]

Prints the validation win+draw rate (fixed games) before training, every few steps and after.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from task import rollout

import tempering as art


async def validate(model: art.TrainableModel, args) -> dict[str, float]:
    seeds = range(10_000, 10_000 + args.num_val)  # the same opponent dice every time
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(model, seed, opponent=args.opponent)]) for seed in seeds], pbar_desc="validate")
    metrics = await model.log(groups, split="val")
    print(f"  step {await model.get_step()}: win+draw {metrics['val/win_or_draw']:.3f}  win {metrics['val/win']:.3f}  "
          f"invalid {metrics['val/invalid']:.3f}  reward {metrics['val/reward']:.3f}", flush=True)
    return metrics


async def main(args) -> None:
    start = time.perf_counter()
    model = art.TrainableModel(name=args.name or f"ttt-{int(time.time())}", project="tic-tac-toe",
                               base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend(path=args.path))
    before = await validate(model, args)
    for step in range(await model.get_step(), args.steps):
        seeds = [args.seed * 1_000 + step * args.groups_per_step + i for i in range(args.groups_per_step)]
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, seed, opponent=args.opponent) for _ in range(args.group_size))
             for seed in seeds), pbar_desc=f"step {step + 1}/{args.steps}")
        result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
        print(f"step {step + 1}: train/reward {result.metrics['train/reward']:.3f}  "
              f"win+draw {result.metrics['train/win_or_draw']:.3f}  invalid {result.metrics['train/invalid']:.3f}  "
              f"{(time.perf_counter() - start) / 60:.1f} min", flush=True)
        if args.val_every and (step + 1) % args.val_every == 0 and step + 1 < args.steps:
            await validate(model, args)
    after = await validate(model, args)
    print(f"win+draw {before['val/win_or_draw']:.3f} -> {after['val/win_or_draw']:.3f} in "
          f"{(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--opponent", choices=["random", "blocking"], default="random")
    parser.add_argument("--num-val", type=int, default=64)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None)
    parser.add_argument("--path", default=".tempering")
    asyncio.run(main(parser.parse_args()))
