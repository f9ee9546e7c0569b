"""PipelineTrainer: rollouts keep running while the model trains (ART's `PipelineTrainer` shape).

Three stages run concurrently in the caller's event loop:

- rollout workers take scenarios, run a group of rollouts each through `model.openai_client()`,
  and queue the finished group. A worker starts a group only while the groups finished or in
  flight leave its tokens within `max_staleness` steps of the policy they will be trained from
  (see staleness.py), so no rollout is started only to be thrown away;
- the trainer takes the first `groups_per_step` queued groups as soon as they are there, drops
  (and counts) any whose oldest token is more than `max_staleness` steps old, and calls
  `model.train` with them. The backend keeps sampling during the step (the engine reads the live
  adapter), so a rollout that spans the step takes its later tokens from the new policy; every
  token carries the logprob and policy version it was sampled with, and the loss's importance
  ratio is taken against exactly those logprobs (bounded by TrainConfig's clipping, TIS or
  masking);
- validation runs `eval_fn(model, step, config)` at chosen steps in the background, against the
  saved checkpoint of that step (`model.get_inference_name(step)`), while the other two go on.

It uses only the public pieces of the explicit loop (`gather_trajectory_groups`, `model.train`,
`model.log`), so it runs on `LocalBackend` and `RemoteBackend` alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from ..errors import ConfigError, TrajectoryError
from ..gather import gather_trajectory_groups
from ..types import TrainConfig, Trajectory, TrajectoryGroup
from .staleness import group_staleness, max_groups_ahead, stamp_versions

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..model import TrainableModel

__all__ = ["PipelineResult", "PipelineTrainer", "make_group_rollout_fn"]

RolloutFn = Callable[[Any, Any, Any], Awaitable[Any]]
EvalFn = Callable[[Any, int, Any], Awaitable[Sequence[Trajectory | TrajectoryGroup] | Mapping[str, Sequence[Any]]]]


def make_group_rollout_fn(single_rollout_fn: RolloutFn, n: int = 4) -> RolloutFn:
    """A group rollout function from a single-rollout one (ART's helper): `n` rollouts of a scenario.

    The returned `async f(model, scenario, config)` gives a TrajectoryGroup; failed rollouts are
    kept in its `exceptions` within the pipeline's `max_exceptions`.
    """
    if n < 1:
        raise ConfigError(f"a group needs at least one rollout, got n={n}")

    async def group_rollout(model: Any, scenario: Any, config: Any) -> TrajectoryGroup:
        return await TrajectoryGroup(single_rollout_fn(model, scenario, config) for _ in range(n))

    return group_rollout


@dataclass(slots=True)
class PipelineResult:
    """What a pipelined run did.

    Attributes:
        step: the model's step at the end.
        num_steps: training steps taken by this run.
        num_groups_trained, num_trajectories_trained: what those steps were given.
        num_stale_groups_dropped: finished groups older than `max_staleness` steps, not trained.
        num_failed_groups: groups whose every rollout failed.
        val_rewards: mean `val` reward of each validated step.
        step_wall_s: seconds of each training step counted from the end of the one before (the
            first from the start of the run, so it includes filling the pipeline).
        wall_s: seconds from start to end, validation included.
    """

    step: int
    num_steps: int = 0
    num_groups_trained: int = 0
    num_trajectories_trained: int = 0
    num_stale_groups_dropped: int = 0
    num_failed_groups: int = 0
    val_rewards: dict[int, float] = field(default_factory=dict)
    step_wall_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


class PipelineTrainer:
    """Trains `model` on rollouts of `scenarios` while more rollouts run.

    Args:
        model: a TrainableModel already registered with `backend`.
        backend: the backend it is registered with (ART's argument; None: the model's own).
        rollout_fn: `async rollout_fn(model, scenario, config)` returning a TrajectoryGroup, or,
            with `group_size`, one Trajectory (then run `group_size` times per scenario).
        scenarios: an iterable or async iterable of scenarios; the run ends when it is exhausted
            (or after `max_steps`).
        config: passed to `rollout_fn` and `eval_fn` as is.
        eval_fn: `async eval_fn(model, step, config)` returning trajectories or groups (logged as
            the "val" split of `step`) or a mapping split -> them. It should sample from
            `model.get_inference_name(step)`, the saved checkpoint of that step, since training
            goes on meanwhile.
        group_size: rollouts per scenario when `rollout_fn` returns one Trajectory.
        groups_per_step: groups per training step (ART: `min_batch_size`).
        max_staleness: the most training steps a trained token may lag the policy it is trained
            from (ART: `max_steps_off_policy`). 0: on-policy, no rollout runs during a step.
        num_rollout_workers: concurrent groups at most (default: as many as the staleness bound
            allows, `groups_per_step * (max_staleness + 1)`).
        train_config: the options of each `model.train` call (default `TrainConfig()`). Unless it
            sets `decoupled`, the pipeline trains with `decoupled=True` (AReaL's objective: a
            token sampled before the last update keeps its gradient, weighted by π_prox /
            π_sampled, where PPO's clip against its sampling policy would drop it); on the
            demo's task it closed most of the pipeline's gap to the sequential loop.
        learning_rate, loss_fn, kl_penalty_coef: ART's names; when given they override those
            fields of `train_config`.
        max_steps: stop after this many training steps (default: until the scenarios run out).
        eval_every_n_steps: validate every this many steps (0: never), and after the last step.
        eval_at_start: validate the starting step too.
        max_exceptions: failed rollouts tolerated per group (a value in (0, 1) is a fraction of
            the group; a `rollout_fn` that raises itself counts as one failed rollout of a group
            of 1, and its group as failed); one more re-raises and stops the run.
        pbar: show a progress bar over steps.

    Raises:
        ConfigError: for invalid options, or a model not registered with `backend`.
    """

    def __init__(
        self,
        model: TrainableModel,
        backend: Backend | None,
        rollout_fn: RolloutFn,
        scenarios: Iterable[Any] | AsyncIterable[Any],
        config: Any = None,
        eval_fn: EvalFn | None = None,
        *,
        group_size: int | None = None,
        groups_per_step: int | None = None,
        min_batch_size: int | None = None,
        max_staleness: int | None = None,
        max_steps_off_policy: int | None = None,
        num_rollout_workers: int | None = None,
        train_config: TrainConfig | None = None,
        learning_rate: float | None = None,
        loss_fn: str | None = None,
        kl_penalty_coef: float | None = None,
        max_steps: int | None = None,
        eval_every_n_steps: int = 20,
        eval_at_start: bool = True,
        max_exceptions: int | float = 0,
        pbar: bool = True,
    ) -> None:
        if backend is not None and model._backend is not backend:
            raise ConfigError(f"model {model.name!r} is not registered with this backend; `await model.register(backend)` first")
        self.model = model
        self.rollout_fn = rollout_fn if group_size is None else make_group_rollout_fn(rollout_fn, group_size)
        self.config = config
        self.eval_fn = eval_fn
        self.groups_per_step = _one_of("groups_per_step", groups_per_step, "min_batch_size", min_batch_size, default=4)
        self.max_staleness = _one_of("max_staleness", max_staleness, "max_steps_off_policy", max_steps_off_policy, default=1)
        if self.groups_per_step < 1:
            raise ConfigError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        self.num_rollout_workers = num_rollout_workers or self.groups_per_step * (self.max_staleness + 1)
        if self.num_rollout_workers < 1:
            raise ConfigError(f"num_rollout_workers must be >= 1, got {self.num_rollout_workers}")
        overrides = {k: v for k, v in (("learning_rate", learning_rate), ("loss_fn", loss_fn),
                                       ("kl_penalty_coef", kl_penalty_coef)) if v is not None}
        base = train_config or TrainConfig()
        if "decoupled" not in base.model_fields_set:  # stale tokens keep their gradient (TrainConfig.decoupled)
            overrides["decoupled"] = True
        self.train_config = TrainConfig(**{**base.model_dump(exclude_unset=True), **overrides})
        if max_steps is not None and max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {max_steps}")
        if eval_every_n_steps < 0:
            raise ConfigError(f"eval_every_n_steps must be >= 0, got {eval_every_n_steps}")
        self.max_steps = max_steps
        self.eval_every_n_steps = eval_every_n_steps
        self.eval_at_start = eval_at_start
        self.max_exceptions = max_exceptions
        self.pbar = pbar
        self._scenarios = _aiter(scenarios)

    # ---- the run ------------------------------------------------------------------------------

    async def train(self, *, handle_signals: bool = True) -> PipelineResult:
        """Run the pipeline until `max_steps` or the end of the scenarios; returns what it did.

        `handle_signals` is accepted for ART compatibility: tempering installs no signal handlers;
        Ctrl-C (or cancelling the task) cancels every stage, and the last saved step stays good.

        Raises:
            Exception: whatever a rollout raised past `max_exceptions`, or a training call raised;
                the other stages are cancelled first (when several fail at once, the first
                error). A failed validation is logged and does not stop the run.
        """
        start = time.perf_counter()
        self._version = await self.model.get_step()
        self._result = PipelineResult(step=self._version)
        self._ready: list[TrajectoryGroup] = []
        self._num_running = 0
        self._is_training = False
        self._is_exhausted = False
        self._changed = asyncio.Condition()
        self._scenario_lock = asyncio.Lock()
        self._evals: asyncio.Queue[int | None] = asyncio.Queue()
        self._bar = tqdm(total=self.max_steps, desc="pipeline", unit="step", disable=not self.pbar, dynamic_ncols=True)
        try:
            await self._run_stages()
        except BaseExceptionGroup as group:  # stages failed and the others were cancelled: raise the first error
            raise group.exceptions[0] from None
        finally:
            self._bar.close()
        self._result.step = self._version
        self._result.wall_s = time.perf_counter() - start
        return self._result

    async def _run_stages(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            evaluator = tasks.create_task(self._eval_stage())
            if self.eval_fn is not None and self.eval_at_start:
                self._evals.put_nowait(self._version)
            workers = [tasks.create_task(self._rollout_worker()) for _ in range(self.num_rollout_workers)]
            await self._training_stage()
            async with self._changed:
                self._is_exhausted = True  # stop the workers; cancel rollouts nobody will train on
                self._changed.notify_all()
            for worker in workers:
                worker.cancel()
            self._evals.put_nowait(None)
            await evaluator

    # ---- rollouts -----------------------------------------------------------------------------

    def _may_start(self) -> bool:
        ahead = len(self._ready) + self._num_running
        bound = max_groups_ahead(groups_per_step=self.groups_per_step, max_staleness=self.max_staleness,
                                 is_training=self._is_training)
        if self.max_steps is not None:  # never start groups beyond what the remaining steps train
            steps_left = self.max_steps - self._result.num_steps - (1 if self._is_training else 0)
            bound = min(bound, steps_left * self.groups_per_step)
        return ahead < bound

    async def _next_scenario(self) -> tuple[bool, Any]:
        async with self._scenario_lock:
            try:
                return True, await anext(self._scenarios)
            except StopAsyncIteration:
                return False, None

    async def _rollout_worker(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._is_exhausted or self._may_start())
                if self._is_exhausted:
                    return
                self._num_running += 1  # claimed before the next await: the bound holds for every worker
            try:
                found, scenario = await self._next_scenario()
                if found:
                    started = self._version
                    group = await self._run_group(scenario)
                    stamp_versions(group, started=started, finished=self._version)
            except BaseException:
                async with self._changed:
                    self._num_running -= 1
                    self._changed.notify_all()
                raise
            async with self._changed:  # running -> ready in one step: the trainer never sees it in neither
                self._num_running -= 1
                if not found:
                    self._is_exhausted = True
                elif group.trajectories:
                    self._ready.append(group)
                else:
                    self._result.num_failed_groups += 1
                self._changed.notify_all()
            if not found:
                return

    async def _run_group(self, scenario: Any) -> TrajectoryGroup:
        """One gather per group, so a fractional `max_exceptions` is a fraction of the group."""
        item = self.rollout_fn(self.model, scenario, self.config)
        groups = await gather_trajectory_groups([item], pbar_desc=None, max_exceptions=self.max_exceptions)
        if not groups:  # rollout_fn itself raised, within the budget: a failed group
            return TrajectoryGroup()
        if len(groups) != 1:
            raise TrajectoryError(f"rollout_fn must give one TrajectoryGroup per scenario, got {len(groups)}")
        return groups[0]

    # ---- training -----------------------------------------------------------------------------

    async def _next_batch(self) -> list[TrajectoryGroup]:
        """The next `groups_per_step` fresh groups (fewer at the end of the scenarios; [] when none)."""
        async with self._changed:
            while True:
                fresh = [g for g in self._ready if group_staleness(g, self._version) <= self.max_staleness]
                if len(fresh) < len(self._ready):  # their slots free up: workers may start replacements
                    self._result.num_stale_groups_dropped += len(self._ready) - len(fresh)
                    self._ready = fresh
                    self._changed.notify_all()
                done = self._is_exhausted and self._num_running == 0
                if len(self._ready) >= self.groups_per_step or (done and self._ready):
                    batch, self._ready = self._ready[:self.groups_per_step], self._ready[self.groups_per_step:]
                    self._is_training = True  # in the same critical section: workers see the tighter bound
                    self._changed.notify_all()
                    return batch
                if done:
                    return []
                await self._changed.wait()

    async def _training_stage(self) -> None:
        result = self._result
        last_end = time.perf_counter()
        while self.max_steps is None or result.num_steps < self.max_steps:
            wait_start = time.perf_counter()
            batch = await self._next_batch()
            if not batch:  # the scenarios ran out: validate the last step, unless it just was
                if (self.eval_fn is not None and self.eval_every_n_steps and result.num_steps
                        and self._version % self.eval_every_n_steps):
                    self._evals.put_nowait(self._version)
                return
            idle_s = time.perf_counter() - wait_start
            num_in_flight = self._num_running
            data_step = self._version
            try:
                train = await self.model.train(batch, config=self.train_config)
            except BaseException:
                async with self._changed:
                    self._is_training = False
                    self._changed.notify_all()
                raise
            async with self._changed:  # the new version, the step count and the looser bound together
                self._version = train.step
                self._is_training = False
                result.num_steps += 1
                self._changed.notify_all()
            now = time.perf_counter()
            result.step_wall_s.append(now - last_end)
            last_end = now
            result.num_groups_trained += len(batch)
            result.num_trajectories_trained += sum(len(g) for g in batch)
            await self.model.log(None, split="train", step=data_step, metrics={
                "pipeline/num_stale_groups_dropped": float(result.num_stale_groups_dropped),
                "pipeline/num_failed_groups": float(result.num_failed_groups),
                "pipeline/num_groups_in_flight": float(num_in_flight),
                "time/step_trainer_idle_s": idle_s,
            })
            self._bar.set_postfix({"reward": f"{train.metrics.get('train/reward', float('nan')):.3f}",
                                   "stale": result.num_stale_groups_dropped}, refresh=False)
            self._bar.update(1)
            is_last = self.max_steps is not None and result.num_steps == self.max_steps
            if self.eval_fn is not None and self.eval_every_n_steps and (
                    train.step % self.eval_every_n_steps == 0 or is_last):
                self._evals.put_nowait(train.step)

    # ---- validation ---------------------------------------------------------------------------

    async def _eval_stage(self) -> None:
        """Validate queued steps one at a time, beside the other stages, until a None arrives."""
        while (step := await self._evals.get()) is not None:
            try:
                output = await self.eval_fn(self.model, step, self.config)
                splits = output if isinstance(output, Mapping) else {"val": output}
                for split, items in splits.items():
                    if not items:
                        continue
                    row = await self.model.log(list(items), split=split, step=step)
                    if split == "val" and "val/reward" in row:
                        self._result.val_rewards[step] = row["val/reward"]
            except Exception as exc:  # a failed validation is reported, never the end of a run
                tqdm.write(f"validation of step {step} failed: {exc!r}")


def _one_of(name: str, value: int | None, art_name: str, art_value: int | None, *, default: int) -> int:
    if value is not None and art_value is not None and value != art_value:
        raise ConfigError(f"{name}={value} and {art_name}={art_value} are the same option; give one")
    return value if value is not None else art_value if art_value is not None else default


def _aiter(scenarios: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(scenarios, AsyncIterable):
        return aiter(scenarios)

    async def from_iterable() -> AsyncIterator[Any]:
        for scenario in scenarios:
            yield scenario

    return from_iterable()
