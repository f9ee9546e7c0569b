"""`tempering demo`: train the default model on addition and show the validation reward rise.

The loop is the explicit one (gather, then train) by default; with `max_staleness` it is a
PipelineTrainer on the same problems in the same order, validating the saved steps in the
background (benchmarks/pipeline_learning.py compares the two).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends.local import LocalBackend
from ..gather import gather_trajectory_groups
from ..model import TrainableModel
from ..pipeline_trainer import PipelineTrainer
from ..service.base_model import DEFAULT_BASE_MODEL
from ..service.builtin_models import builtin_model
from ..storage import ModelPaths, plot_history, read_history
from ..types import TrainConfig, TrajectoryGroup
from .task import AdditionTask, RepeatWordTask, Scenario

__all__ = ["TASKS", "DemoResult", "default_task", "run_demo"]

TASKS = {"addition": AdditionTask, "repeat-word": RepeatWordTask}


def default_task(base_model: str) -> str:
    """The demo task `base_model` learns: a built-in model's own (`BuiltinModel.demo_task`: repeat-word for
    the pretrained gemma-3-270m), else addition."""
    builtin = builtin_model(base_model)
    return builtin.demo_task if builtin is not None else "addition"


@dataclass(slots=True)
class DemoResult:
    model_name: str
    val_reward_before: float
    val_reward_after: float
    train_rewards: list[float] = field(default_factory=list)
    val_rewards: dict[int, float] = field(default_factory=dict)  # step -> validation reward
    num_trajectories_trained: int = 0
    seconds: float = 0.0
    training_seconds: float = 0.0  # from the end of the first validation to the end of the last
    plot_path: Path | None = None
    history_path: Path | None = None

    @property
    def improvement(self) -> float:
        return self.val_reward_after - self.val_reward_before


async def _validate(model: TrainableModel, task: AdditionTask | RepeatWordTask, scenarios: list[Scenario], samples: int,
                    step: int | None = None) -> float:
    """The mean reward on `scenarios` of the live policy, or of saved `step` (logged at that step)."""
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(task.rollout(model, s, step=step) for _ in range(samples)) for s in scenarios),
        pbar_desc="validate" if step is None else None,
    )
    metrics = await model.log(groups, split="val", step=step)
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
    max_staleness: int | None = None,
    train_options: dict[str, Any] | None = None,
    base_model: str = DEFAULT_BASE_MODEL,
    task: str | None = None,
    device: str | None = None,
    engine_config: dict[str, Any] | None = None,
    dtype: str | None = None,
    gpus: int = 1,
    dedicated: bool = False,
    echo: Callable[[str], None] = print,
) -> DemoResult:
    """Train on `steps` × `groups_per_step` addition problems (`group_size` rollouts each).

    Validation uses `num_val` held-out problems, `val_samples` samples each, at the rollout
    temperature, before the first step, every `val_every` steps and after the last.
    `max_staleness` (None: the sequential gather-then-train loop) pipelines the same steps.
    `train_options`: more TrainConfig fields (e.g. {"loss_fn": "cispo"} or {"decoupled": True}).
    `base_model`: the model to train (any `base_model` that `TrainableModel` takes, e.g. "gemma-3-270m").
    `task`: "addition", or "repeat-word" (task.py) for a pretrained model that cannot follow the addition prompt
        (None: the built-in model's own, `default_task`).
    `device`: "cpu" or "cuda" (default: CUDA when available).
    `engine_config`: EngineConfig fields (e.g. {"batch_invariant": True}: exact on-policy).
    `dtype`: the model's dtype ("bfloat16", "float32", ...; None: the service's default, float32 for this 135M model on a GPU as on a CPU).
    `gpus`, `dedicated`: `LocalBackend(gpus=..., dedicated=...)`: data parallel over `gpus` processes, or
    with `dedicated` GPU 0 training while the others serve (and take part in each step while idle).
    """
    start = time.perf_counter()
    task_name = task or default_task(base_model)
    task = TASKS[task_name]()
    val_scenarios = task.scenarios(num_val, seed=seed + 10_000)
    name = name or "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    model = TrainableModel(name=name, project="tempering-demo", base_model=base_model)
    if dtype is not None:  # ART's option, as a user sets it
        model._internal_config = {"engine_args": {"dtype": dtype}}
    async with LocalBackend(path=path, device=device, engine_config=engine_config, gpus=gpus,
                            dedicated=dedicated) as backend:
        echo(f"loading {base_model} (a built-in model is converted from GGUF on its first run); task: {task_name} ...")
        await model.register(backend)
        echo(f"validation before training: {num_val} held-out problems x {val_samples} samples")
        before = await _validate(model, task, val_scenarios, val_samples)
        echo(f"  val/reward = {before:.3f}")
        result = DemoResult(name, before, before, val_rewards={await model.get_step(): before})
        config = TrainConfig(learning_rate=learning_rate, **(train_options or {}))
        held_out = set(val_scenarios)
        training_start = time.perf_counter()
        if max_staleness is None:
            await _sequential(model, task, result, steps=steps, groups_per_step=groups_per_step, group_size=group_size,
                              config=config, seed=seed, held_out=held_out, val=(val_scenarios, val_samples, val_every),
                              echo=echo)
        else:
            await _pipelined(model, backend, task, result, steps=steps, groups_per_step=groups_per_step,
                             group_size=group_size, config=config, max_staleness=max_staleness, seed=seed,
                             held_out=held_out, val=(val_scenarios, val_samples, val_every), echo=echo)
        result.training_seconds = time.perf_counter() - training_start
    paths = ModelPaths(path, model.project, name)
    result.history_path = paths.history
    result.plot_path = plot_history(
        {name: read_history(paths.history)},
        paths.plots_dir / "reward.png",
        metrics=("train/reward", "val/reward"),
        overlay=True,
        title=f"tempering demo: {base_model} on {task_name}",
    )
    result.seconds = time.perf_counter() - start
    return result


async def _sequential(model: TrainableModel, task: AdditionTask | RepeatWordTask, result: DemoResult, *, steps: int,
                      groups_per_step: int, group_size: int, config: TrainConfig, seed: int, held_out: set[Scenario],
                      val: tuple[list[Scenario], int, int], echo: Callable[[str], None]) -> None:
    """The explicit loop: gather a step's groups, train on them, validate every `val_every` steps."""
    val_scenarios, val_samples, val_every = val
    for step in range(await model.get_step(), steps):
        scenarios = task.scenarios(groups_per_step, seed=seed + step, exclude=held_out)
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(task.rollout(model, s) for _ in range(group_size)) for s in scenarios),
            pbar_desc=f"step {step + 1}/{steps}",
        )
        train = await model.train(groups, config=config)
        reward = train.metrics.get("train/reward", float("nan"))
        result.train_rewards.append(reward)
        result.num_trajectories_trained += sum(len(g) for g in groups)
        echo(f"step {step + 1:>2}/{steps}: train/reward {reward:.3f}  {_step_summary(train.metrics, groups_per_step)}")
        if step + 1 == steps or (val_every and (step + 1) % val_every == 0):
            result.val_reward_after = await _validate(model, task, val_scenarios, val_samples)
            result.val_rewards[step + 1] = result.val_reward_after
            echo(f"  val/reward after step {step + 1} = {result.val_reward_after:.3f}")


async def _pipelined(model: TrainableModel, backend: LocalBackend, task: AdditionTask | RepeatWordTask,
                     result: DemoResult, *,
                     steps: int, groups_per_step: int, group_size: int, config: TrainConfig, max_staleness: int,
                     seed: int, held_out: set[Scenario], val: tuple[list[Scenario], int, int],
                     echo: Callable[[str], None]) -> None:
    """The demo's steps through a PipelineTrainer: the problems of step k are `seed + k`'s, in order."""
    start = await model.get_step()
    scenarios = [s for step in range(start, steps) for s in task.scenarios(groups_per_step, seed=seed + step, exclude=held_out)]
    val_scenarios, val_samples, val_every = val

    async def rollout(model, scenario, _config):
        return await task.rollout(model, scenario)

    async def evaluate(model, step, _config):
        reward = await _validate(model, task, val_scenarios, val_samples, step=step)
        echo(f"  val/reward after step {step} = {reward:.3f}")
        result.val_rewards[step] = reward
        return []  # already logged at `step`

    echo(f"pipelined: {steps - start} steps, max_staleness={max_staleness}")
    pipeline = PipelineTrainer(model, backend, rollout, scenarios, eval_fn=evaluate, group_size=group_size,
                               groups_per_step=groups_per_step, max_staleness=max_staleness, max_steps=steps - start,
                               train_config=config, eval_every_n_steps=val_every or steps, eval_at_start=False)
    done = await pipeline.train()
    result.num_trajectories_trained += done.num_trajectories_trained
    if result.val_rewards:
        result.val_reward_after = result.val_rewards[max(result.val_rewards)]
    rows = [r for r in await backend._read_history(model) if "train/reward" in r and r["step"] >= start]
    result.train_rewards += [r["train/reward"] for r in sorted(rows, key=lambda r: r["step"])]


def _step_summary(metrics: dict[str, float], num_groups: int) -> str:
    """What a training step did, for the demo's line: its loss and trainable groups, or why nothing trained."""
    trainable = int(metrics.get("data/step_num_groups_trainable", 0))
    seconds = f"{metrics.get('time/step_wall_s', 0):.1f} s"
    if not trainable:
        return f"nothing to train (no group had a reward spread; the adapter is unchanged)  {seconds}"
    skipped = int(metrics.get("loss/num_updates_skipped", 0))
    note = f"  ({skipped} update(s) skipped: non-finite gradient)" if skipped else ""
    return (f"loss {metrics.get('loss/train', float('nan')):+.4f}  grad norm {metrics.get('loss/grad_norm', float('nan')):.2f}  "
            f"trainable groups {trainable}/{num_groups}  {seconds}{note}")


def run_demo(**kwargs) -> DemoResult:
    """`run_demo_async` in a fresh event loop."""
    return asyncio.run(run_demo_async(**kwargs))
