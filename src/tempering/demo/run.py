"""`tempering demo`: train the default model on addition and show the validation reward rise."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.local import LocalBackend
from ..gather import gather_trajectory_groups
from ..model import TrainableModel
from ..service.base_model import DEFAULT_BASE_MODEL
from ..storage import ModelPaths, plot_history, read_history
from ..types import TrainConfig, TrajectoryGroup
from .task import AdditionTask, Scenario

__all__ = ["DemoResult", "run_demo"]


@dataclass(slots=True)
class DemoResult:
    model_name: str
    val_reward_before: float
    val_reward_after: float
    train_rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0
    plot_path: Path | None = None
    history_path: Path | None = None

    @property
    def improvement(self) -> float:
        return self.val_reward_after - self.val_reward_before


async def _validate(model: TrainableModel, task: AdditionTask, scenarios: list[Scenario], samples: int) -> float:
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(task.rollout(model, s) for _ in range(samples)) for s in scenarios), pbar_desc="validate"
    )
    metrics = await model.log(groups, split="val")
    return metrics["val/reward"]


async def run_demo_async(
    *,
    path: Path = Path(".tempering"),
    steps: int = 12,
    groups_per_step: int = 4,
    group_size: int = 8,
    num_val: int = 64,
    val_samples: int = 2,
    learning_rate: float = 2e-4,
    seed: int = 0,
    val_every: int = 4,
    name: str | None = None,
    echo: Callable[[str], None] = print,
) -> DemoResult:
    """Train on `steps` × `groups_per_step` addition problems (`group_size` rollouts each).

    Validation uses `num_val` held-out problems, `val_samples` samples each, at the rollout
    temperature, before the first step, every `val_every` steps and after the last.
    """
    start = time.perf_counter()
    task = AdditionTask()
    val_scenarios = task.scenarios(num_val, seed=seed + 10_000)
    name = name or "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    model = TrainableModel(name=name, project="tempering-demo", base_model=DEFAULT_BASE_MODEL)
    async with LocalBackend(path=path) as backend:
        echo(f"loading {DEFAULT_BASE_MODEL} (the first run converts it from GGUF, about 30 s) ...")
        await model.register(backend)
        echo(f"validation before training: {num_val} held-out problems x {val_samples} samples")
        before = await _validate(model, task, val_scenarios, val_samples)
        echo(f"  val/reward = {before:.3f}")
        result = DemoResult(name, before, before)
        config = TrainConfig(learning_rate=learning_rate)
        held_out = set(val_scenarios)
        for step in range(await model.get_step(), steps):
            scenarios = task.scenarios(groups_per_step, seed=seed + step, exclude=held_out)
            groups = await gather_trajectory_groups(
                (TrajectoryGroup(task.rollout(model, s) for _ in range(group_size)) for s in scenarios),
                pbar_desc=f"step {step + 1}/{steps}",
            )
            train = await model.train(groups, config=config)
            reward = train.metrics.get("train/reward", float("nan"))
            result.train_rewards.append(reward)
            echo(
                f"step {step + 1:>2}/{steps}: train/reward {reward:.3f}  "
                f"loss {train.metrics.get('loss/train', float('nan')):+.4f}  "
                f"trainable groups {int(train.metrics.get('data/step_num_groups_trainable', 0))}/{groups_per_step}  "
                f"{train.metrics.get('time/step_wall_s', 0):.1f} s"
            )
            if step + 1 == steps or (val_every and (step + 1) % val_every == 0):
                result.val_reward_after = await _validate(model, task, val_scenarios, val_samples)
                echo(f"  val/reward after step {step + 1} = {result.val_reward_after:.3f}")
    paths = ModelPaths(path, model.project, name)
    result.history_path = paths.history
    result.plot_path = plot_history(
        {name: read_history(paths.history)},
        paths.plots_dir / "reward.png",
        metrics=("train/reward", "val/reward"),
        overlay=True,
        title=f"tempering demo: {DEFAULT_BASE_MODEL} on addition",
    )
    result.seconds = time.perf_counter() - start
    return result


def run_demo(**kwargs) -> DemoResult:
    """`run_demo_async` in a fresh event loop."""
    return asyncio.run(run_demo_async(**kwargs))
