"""Train SmolLM2-135M-Instruct to play 2048 on a 3x3 board (CPU is enough).

    python examples/game_2048/train.py [--steps 10] [--seed 0]

Prints the average reached tile on fixed validation games before training, every few steps and after.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from task import rollout

import tempering as art


async def validate(model: art.TrainableModel, args) -> dict[str, float]:
    seeds = range(10_000, 10_000 + args.num_val)  # the same tile dice every time
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(model, seed, target=args.target, max_moves=args.max_moves)]) for seed in seeds], pbar_desc="validate")
    metrics = await model.log(groups, split="val")
    print(f"  step {await model.get_step()}: average max tile {metrics['val/max_tile']:.1f}  reached {args.target} "
          f"{metrics['val/reached_target']:.3f}  illegal {metrics['val/illegal']:.3f}  moves down/left/right/up {metrics['val/share_down']:.2f}/"
          f"{metrics['val/share_left']:.2f}/{metrics['val/share_right']:.2f}/{metrics['val/share_up']:.2f}", flush=True)
    return metrics


async def main(args) -> None:
    start = time.perf_counter()
    model = art.TrainableModel(name=args.name or f"2048-{int(time.time())}", project="game-2048",
                               base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend(path=args.path))
    before = await validate(model, args)
    for step in range(await model.get_step(), args.steps):
        seeds = [args.seed * 1_000 + step * args.groups_per_step + i for i in range(args.groups_per_step)]
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, seed, target=args.target, max_moves=args.max_moves) for _ in range(args.group_size))
             for seed in seeds), pbar_desc=f"step {step + 1}/{args.steps}")
        result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
        print(f"step {step + 1}: train/reward {result.metrics['train/reward']:.3f}  max tile "
              f"{result.metrics['train/max_tile']:.1f}  illegal {result.metrics['train/illegal']:.3f}  "
              f"{(time.perf_counter() - start) / 60:.1f} min", flush=True)
        if args.val_every and (step + 1) % args.val_every == 0 and step + 1 < args.steps:
            await validate(model, args)
    after = await validate(model, args)
    print(f"average max tile {before['val/max_tile']:.1f} -> {after['val/max_tile']:.1f} in "
          f"{(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--target", type=int, default=64)
    parser.add_argument("--max-moves", type=int, default=60)
    parser.add_argument("--num-val", type=int, default=32)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None)
    parser.add_argument("--path", default=".tempering")
    asyncio.run(main(parser.parse_args()))
