"""Train SmolLM2-135M-Instruct to use a calculator tool over two turns (ART-style loop; CPU is enough).

    python examples/calculator_agent/train.py [--steps 8]

Prints the validation reward (held-out problems) before and after training.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from task import rollout, scenarios

import tempering as art


async def validate(model: art.TrainableModel, problems) -> dict[str, float]:
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, p) for _ in range(2)) for p in problems), pbar_desc="validate")
    return await model.log(groups, split="val")


async def main(steps: int, groups_per_step: int, group_size: int, learning_rate: float, path: str) -> None:
    start = time.perf_counter()
    model = art.TrainableModel(name=f"calculator-{int(time.time())}", project="calculator-agent",
                               base_model="SmolLM2-135M-Instruct")
    await model.register(art.LocalBackend(path=path))
    held_out = scenarios(32, seed=10_000)
    before = await validate(model, held_out)
    print(f"before: val/reward {before['val/reward']:.3f}  well-formed calls {before['val/tool_call_well_formed']:.2f}  "
          f"correct calls {before['val/tool_call_correct']:.2f}  correct answers {before['val/answer_correct']:.2f}")
    for step in range(await model.get_step(), steps):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, s) for _ in range(group_size)) for s in scenarios(groups_per_step, seed=step)),
            pbar_desc=f"step {step + 1}/{steps}")
        result = await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate))
        print(f"step {step + 1}: train/reward {result.metrics['train/reward']:.3f}")
    after = await validate(model, held_out)
    print(f"after:  val/reward {after['val/reward']:.3f}  well-formed calls {after['val/tool_call_well_formed']:.2f}  "
          f"correct calls {after['val/tool_call_correct']:.2f}  correct answers {after['val/answer_correct']:.2f}")
    print(f"{(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--path", default=".tempering")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.groups_per_step, args.group_size, args.learning_rate, args.path))
