"""Train SmolLM2-135M-Instruct to answer questions about a synthetic inbox with search tools (CPU is enough).

    python examples/email_agent/train.py [--steps 24] [--reward exact|ruler] [--seed 0]

Prints the answer accuracy on held-out questions before training, every few steps and after.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from inbox import build_inbox
from task import rollout

import tempering as art


async def validate(model: art.TrainableModel, db, questions, samples: int, max_turns: int) -> dict[str, float]:
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, db, q, max_turns=max_turns) for _ in range(samples)) for q in questions),
        pbar_desc="validate")
    metrics = await model.log(groups, split="val")
    print(f"  step {await model.get_step()}: accuracy {metrics['val/correct']:.3f}  found email "
          f"{metrics['val/found_email']:.3f}  reward {metrics['val/reward']:.3f}", flush=True)
    return metrics


async def main(args) -> None:
    start = time.perf_counter()
    db, questions = build_inbox(seed=args.seed)
    held_out, train = questions[:args.num_val], questions[args.num_val:]
    model = art.TrainableModel(name=args.name or f"email-{int(time.time())}", project="email-agent",
                               base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend(path=args.path))

    async def judge(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        # RULER ranks the group's answers; the judge is the untrained base model (step 0), frozen
        return await art.rewards.ruler_score_group(group, f"{model.name}@0", client=model.openai_client(),
                                                   swallow_exceptions=True)

    before = await validate(model, db, held_out, args.val_samples, args.max_turns)
    for step in range(await model.get_step(), args.steps):
        batch = [train[(step * args.groups_per_step + i) % len(train)] for i in range(args.groups_per_step)]
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, db, q, max_turns=args.max_turns) for _ in range(args.group_size))
             for q in batch),
            pbar_desc=f"step {step + 1}/{args.steps}", after_each=judge if args.reward == "ruler" else None)
        result = await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
        print(f"step {step + 1}: train/reward {result.metrics['train/reward']:.3f}  "
              f"accuracy {result.metrics['train/correct']:.3f}  {(time.perf_counter() - start) / 60:.1f} min", flush=True)
        if args.val_every and (step + 1) % args.val_every == 0 and step + 1 < args.steps:
            await validate(model, db, held_out, args.val_samples, args.max_turns)
    after = await validate(model, db, held_out, args.val_samples, args.max_turns)
    print(f"accuracy {before['val/correct']:.3f} -> {after['val/correct']:.3f} in {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--groups-per-step", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--reward", choices=["exact", "ruler"], default="exact")
    parser.add_argument("--num-val", type=int, default=24)
    parser.add_argument("--val-samples", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3, help="tool calls per episode, the last a forced answer (>= 2)")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps too (0: before and after only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None)
    parser.add_argument("--path", default=".tempering")
    args = parser.parse_args()
    if args.max_turns < 2:
        parser.error("--max-turns must be at least 2: a search, then the forced final answer")
    asyncio.run(main(args))
