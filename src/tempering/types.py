"""Data that crosses layers: trajectories, groups, configs and results (a leaf module).

These are the user-facing pydantic models of ART's API (`Trajectory`, `TrajectoryGroup`,
`TrainConfig`, ...). A trajectory's `messages_and_choices` mixes plain chat messages (dicts in the
OpenAI format) with `openai` `Choice` objects returned by the server; a `Choice` sampled by
tempering also carries the exact token ids (`choice.token_ids`, `choice.prompt_token_ids`) and the
sampled logprobs (`choice.sampled_logprobs`), which is what training uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from .errors import ConfigError, TrajectoryError

__all__ = [
    "Choice",
    "History",
    "LoRAConfig",
    "Message",
    "MessageOrChoice",
    "Messages",
    "MessagesAndChoices",
    "PydanticException",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "Trajectory",
    "TrajectoryGroup",
]

Message = dict[str, Any]
Messages = list[Message]
MessageOrChoice = Message | Choice
MessagesAndChoices = list[MessageOrChoice]
Tools = list[dict[str, Any]]


def _as_message_or_choice(item: Any) -> MessageOrChoice:
    """Keep dicts and Choices; turn a dumped Choice (it has `finish_reason`) back into a Choice."""
    if isinstance(item, Choice):
        return item
    if isinstance(item, BaseModel):  # e.g. an openai ChatCompletionMessage
        item = item.model_dump(exclude_none=True)
    if not isinstance(item, dict):
        raise TypeError(
            f"messages_and_choices items must be message dicts or openai Choice objects, got {type(item).__name__}"
        )
    if "finish_reason" in item and "message" in item:
        return Choice.model_validate(item)
    return item


def choice_to_message(choice: Choice) -> Message:
    """The assistant message dict that a `Choice` stands for (what the next request sends back)."""
    message: Message = {"role": "assistant", "content": choice.message.content or ""}
    if choice.message.tool_calls:
        message["tool_calls"] = [call.model_dump(exclude_none=True) for call in choice.message.tool_calls]
    return message


class History(BaseModel):
    """A conversation attached to a trajectory besides the main one (a sub-agent call, say)."""

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None

    _check_items = field_validator("messages_and_choices", mode="before")(
        lambda items: [_as_message_or_choice(item) for item in items]
    )

    def messages(self) -> Messages:
        return [choice_to_message(m) if isinstance(m, Choice) else m for m in self.messages_and_choices]


class PydanticException(BaseModel):
    """An exception raised by a rollout, kept in its group as data."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> PydanticException:
        return cls(
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )


class Trajectory(BaseModel):
    """One rollout: the conversation the agent had, and the reward it earned.

    Only `Choice` objects returned by a tempering server (they carry token ids and logprobs) are
    trained on; message dicts are context. `reward` must be finite.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, float | int | str | bool | None] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: float = Field(default_factory=time.monotonic, exclude=True)

    _check_items = field_validator("messages_and_choices", mode="before")(
        lambda items: [_as_message_or_choice(item) for item in items]
    )

    def messages(self) -> Messages:
        """The conversation as plain OpenAI message dicts (each Choice becomes an assistant message)."""
        return [choice_to_message(m) if isinstance(m, Choice) else m for m in self.messages_and_choices]

    def histories(self) -> list[History]:
        """The main conversation followed by `additional_histories`."""
        main = History(messages_and_choices=self.messages_and_choices, tools=self.tools)
        return [main, *self.additional_histories]

    def policy_versions(self) -> list[int]:
        """The policy version (training step) of every sampled token, over all histories in order.

        Read from each Choice's `policy_versions`, which a tempering server stamps on every token
        it samples; tokens of choices without it are left out.
        """
        return [int(v) for history in self.histories() for item in history.messages_and_choices
                if isinstance(item, Choice) for v in getattr(item, "policy_versions", None) or []]

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """Record `metrics["duration"]` (seconds since the trajectory was created) and return self."""
        self.metrics["duration"] = time.monotonic() - self.start_time
        return self

    @contextlib.asynccontextmanager
    async def track_duration(self, name: str) -> AsyncIterator[None]:
        """`async with traj.track_duration("tool"):` adds the block's seconds to `metrics["<name>_duration"]`."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{name}_duration"
            self.metrics[key] = float(self.metrics.get(key, 0.0)) + time.monotonic() - start

    def for_logging(self) -> dict[str, Any]:
        """A JSON-ready dict: the conversation as messages plus reward, metrics, metadata and logs."""
        data = self.model_dump(mode="json", exclude={"messages_and_choices"})
        data["messages"] = self.messages()
        return data


@dataclass(slots=True)
class GatherContext:
    """Exception budget shared by the groups of one `gather_trajectory_groups` call.

    `num_trajectories`, the base of a fractional budget, counts the rollouts of every group known
    so far, and 1 for a coroutine item (ART's `async def rollout_group()`) until the group it
    awaits is known; `counted` holds the ids of the groups and items already in it.
    """

    max_exceptions: int | float = 0
    num_exceptions: int = 0
    num_trajectories: int = 0
    counted: set[int] = field(default_factory=set)

    def count_group(self, group: TrajectoryGroup, item: int | None = None) -> None:
        """Add `group`'s rollouts once; the first group of coroutine item `item` (an id) replaces its 1."""
        if id(group) in self.counted:
            return
        self.counted.add(id(group))
        if item is not None and item not in self.counted:
            self.counted.add(item)
            self.num_trajectories -= 1
        self.num_trajectories += len(group._pending) + len(group.trajectories)

    def allows_one_more_exception(self) -> bool:
        limit = self.max_exceptions
        if 0 < limit < 1:  # a fraction of all trajectories, as in ART
            limit = math.floor(limit * max(self.num_trajectories, 1))
        return self.num_exceptions + 1 <= limit  # (2.5 allows 2, as ART counts and then compares)


gather_context: contextvars.ContextVar[GatherContext | None] = contextvars.ContextVar(
    "tempering_gather_context", default=None
)
gather_item: contextvars.ContextVar[int | None] = contextvars.ContextVar(  # id of the coroutine item being run
    "tempering_gather_item", default=None
)


class TrajectoryGroup(BaseModel):
    """Rollouts of one scenario, compared with each other to compute advantages (GRPO's group).

    Build it from trajectories, or from awaitables that produce them (ART style):
    `TrajectoryGroup(rollout(model, s) for _ in range(8))` is pending until awaited, either by
    `gather_trajectory_groups` or directly with `await group`. Exceptions raised by rollouts are
    kept in `exceptions` while the gather's `max_exceptions` budget allows, else re-raised.
    Exceptions given directly (in `trajectories` or `exceptions=`) are stored as PydanticException.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[PydanticException] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] | None = None,
        *,
        exceptions: Iterable[PydanticException | BaseException] | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float | int | bool] | None = None,
        logs: list[str] | None = None,
        **data: Any,
    ) -> None:
        ready: list[Any] = []
        pending: list[Awaitable[Trajectory]] = []
        errors = [PydanticException.from_exception(e) if isinstance(e, BaseException) else e for e in exceptions or []]
        for item in trajectories if trajectories is not None else data.pop("trajectories", []):
            if isinstance(item, BaseException):
                errors.append(PydanticException.from_exception(item))
            elif isinstance(item, Awaitable):
                pending.append(item)
            else:
                ready.append(item)
        super().__init__(
            trajectories=ready,
            exceptions=errors,
            metadata=metadata or {},
            metrics=metrics or {},
            logs=logs or [],
            **data,
        )
        self._pending = pending

    @property
    def is_pending(self) -> bool:
        return bool(self._pending)

    def __await__(self):
        return self._resolve().__await__()

    async def _resolve(self) -> TrajectoryGroup:
        context = gather_context.get() or GatherContext()
        context.count_group(self, gather_item.get())
        pending, self._pending = self._pending, []
        if not pending:
            return self
        tasks = [asyncio.ensure_future(awaitable) for awaitable in pending]
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    trajectory = await next_done
                except Exception as exc:  # a failed rollout: keep it while the budget allows
                    if not context.allows_one_more_exception():
                        raise
                    context.num_exceptions += 1
                    self.exceptions.append(PydanticException.from_exception(exc))
                    continue
                if not isinstance(trajectory, Trajectory):
                    raise TypeError(
                        f"a rollout in a TrajectoryGroup returned {type(trajectory).__name__}, expected art.Trajectory"
                    )
                self.trajectories.append(trajectory)
        finally:  # stop the other rollouts and wait for them, so their own errors are retrieved here
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self

    def __iter__(self):  # type: ignore[override]  # iterate trajectories, as ART does
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


class LoRAConfig(BaseModel):
    """LoRA hyperparameters of a trainable model's adapter (Hu et al. 2021, arXiv 2106.09685).

    `alpha / rank` scales the update `B @ A`. The defaults match ART (r=8, alpha=16) with LoRA on
    every linear projection of the decoder, as "LoRA Without Regret" (Thinking Machines, 2025)
    recommends for RL.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or NaN would poison the adapter

    rank: int = Field(default=8, ge=1, le=1024)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class _CheckpointRetention(BaseModel):
    """Which checkpoints a training call leaves on disk after saving its own (storage/retention.py).

    `keep_last_checkpoints`: the newest this many are kept (None: every one, as ART's LocalBackend
    does); `best_checkpoint_metric`: the saved step with the highest value of this history metric
    (e.g. "val/reward", logged at the step whose policy it measured) is kept too (None: no best one).
    Only the newest checkpoint holds the optimizer state a resume needs; the others hold the adapter,
    which serving a past step (`name@step`) and `fork` read. The defaults keep 1,000 steps of a
    rank-8 LoRA on a 7B model within about 1.1 GB; `model.delete_checkpoints(...)` still deletes
    more by hand.
    """

    keep_last_checkpoints: int | None = Field(
        default=10, ge=1, description="checkpoints kept, newest first, besides the best (None: all)")
    best_checkpoint_metric: str | None = Field(
        default="val/reward", description="history metric whose highest step is kept too (None: none)")


class TrainConfig(_CheckpointRetention):
    """Options of one training step (`model.train(groups, config=TrainConfig(...))`).

    One call is one RL step: advantages are computed per group, then the trajectories are split
    into `batch_size`-trajectory mini-batches, one optimizer update each (all in one update when
    `batch_size` is None), with gradient accumulation over packed micro-batches of at most
    `micro_batch_tokens` tokens, so a step of any size fits in memory.

    Losses (`loss_fn`), with `ratio = π_new / π_sampled` per token:
    - "ppo": clipped surrogate (Schulman et al. 2017, arXiv 1707.06347; GRPO, arXiv 2402.03300),
      clipped to [1 - epsilon, 1 + epsilon_high] (DAPO clip-higher, arXiv 2503.14476). eps 0.2.
    - "cispo": detached clipped ratio × advantage × logprob (MiniMax-M1, arXiv 2506.13585). eps
      1.0 / 4.0, so the weight stays in [0, 5] (ART's default).
    - "gspo": PPO with the sequence-level ratio exp(mean log-ratio) (arXiv 2507.18071). eps
      3e-4 / 4e-4.

    Aggregation (`loss_aggregation`): "token_mean" (sum over all trained tokens / their count, as
    DAPO and TRL's default), "sequence_mean" (mean over sequences of each one's token mean: the
    original GRPO; GSPO's default) or "dr_grpo" (sum / (sequences × `dr_grpo_normalizer`
    tokens), Dr. GRPO, arXiv 2503.20783).

    Advantages (`advantage_normalization`): reward minus the group mean, then divided by the
    group std ("group"), by the std over the whole batch ("batch", Lite PPO, arXiv 2508.08221) or
    not at all ("none", Dr. GRPO). `normalize_advantages=False` is ART's name for "none".

    KL (`kl_penalty_coef` > 0): `coef × KL(π || π_base)` per token is added to the loss, with the
    `kl_estimator` ("k3" by default, as GRPO); the base policy is the same model with the LoRA
    switched off, so no second model is kept in memory.

    Mismatch between the engine's and the trainer's logprobs: `truncated_importance_sampling=C`
    multiplies each token's loss by min(ratio, C) (detached; TIS, Yao et al. 2025);
    `importance_ratio_mask=(low, high)` drops tokens whose ratio falls outside the band (as
    IcePop/TRL's masking). The ratio statistics are logged every step.

    Stale data (a pipelined loop): `decoupled=True` takes the ratio and its clip against the
    proximal policy, the weights at this update (detached), instead of the sampling policy, and
    weights each token's loss by π_prox / π_sampled capped at `truncated_importance_sampling`
    (2.0 when unset): the decoupled objective of AReaL (Fu et al. 2025, arXiv 2505.24298, eq. 5).
    A token sampled a few policy versions ago keeps its gradient, where PPO's clip against its
    sampling policy drops it once the ratio has left the clip range in the advantage's direction.
    With one update per step (`batch_size` None) and fresh data it equals PPO. With several
    mini-batches, each one's proximal policy is the weights at its own update (AReaL snapshots
    them once per step).

    Structured outputs: `exclude_forced_tokens=True` leaves out of the loss the tokens a grammar
    forced (it allowed only that token; `choice.grammar_forced`). The model made no decision
    there. Keep the default (False) to train on them too, e.g. when a guided choice forces a
    teacher's answer on the student (ART's `guided_completion`), where they are the whole signal.

    Mixture of experts (Qwen3-MoE): with `moe_routing_replay` (default) each token is routed to
    the experts the sampler routed it to (`choice.routed_experts`, which `model.openai_client()`
    asks for), as ART's Megatron backend does; False lets the trainer route by itself (to compare).

    Checkpoints: `save_checkpoint` writes step + 1 (the adapter, and the optimizer state that only the
    newest checkpoint keeps); then `keep_last_checkpoints` and `best_checkpoint_metric` decide which
    older checkpoints stay (the newest 10 and the best by "val/reward" by default; see
    `_CheckpointRetention`). Out of memory inside the step: it is undone and an OutOfMemoryError names
    `micro_batch_tokens`, the setting that bounds its activations.

    Dedicated mode (GPU 0 trains, the others serve): with `work_sharing` (default) a serving GPU
    whose engine has nothing to decode computes part of the step's gradient, micro-batch by
    micro-batch (training/work_sharing.py), for steps with one optimizer update (`batch_size`
    None) outside exact on-policy mode. False keeps every step on GPU 0.
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(default=5e-5, gt=0, allow_inf_nan=False)
    loss_fn: Literal["ppo", "cispo", "gspo"] = "ppo"
    epsilon: float | None = Field(default=None, gt=0, description="clip low; default by loss_fn")
    epsilon_high: float | None = Field(default=None, gt=0, description="clip high; default by loss_fn")
    loss_aggregation: Literal["token_mean", "sequence_mean", "dr_grpo"] | None = None
    dr_grpo_normalizer: int | None = Field(default=None, ge=1, description="tokens; default: longest completion")
    normalize_advantages: bool = True
    advantage_normalization: Literal["group", "batch", "none"] | None = None
    batch_size: int | None = Field(default=None, ge=1, description="trajectories per optimizer update")
    micro_batch_tokens: int = Field(default=16384, ge=64, description="tokens per forward/backward pass")
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    lora_rank: int | None = Field(default=None, ge=1, description="LoRA rank; fixed by the model's first step")
    lora_alpha: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                     description="LoRA alpha; fixed by the model's first step")
    kl_penalty_coef: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    beta: float | None = Field(default=None, ge=0, description="ART <= 0.4 name of kl_penalty_coef")
    truncated_importance_sampling: float | None = Field(default=None, gt=0)
    importance_ratio_mask: tuple[float, float] | None = None
    decoupled: bool = Field(default=False, description="clip against the current weights, weight by π_prox/π_sampled (AReaL)")
    exclude_forced_tokens: bool = Field(
        default=False, description="leave tokens a grammar forced (structured outputs: the only allowed token) out of the loss")
    moe_routing_replay: bool = Field(
        default=True, description="mixture of experts: route each token to the experts the sampler chose for it "
                                  "(`choice.routed_experts`), so the trainer computes the function that sampled")
    gradient_checkpointing: bool = True
    cuda_graphs: bool = Field(default=True, description="on a GPU, replay each row's forward/backward from a CUDA graph")
    logprob_chunk_size: int = Field(default=1024, ge=16)
    save_checkpoint: bool = True
    work_sharing: bool = Field(default=True, description="dedicated mode: idle serving GPUs compute part of the "
                                                         "step's gradient")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.beta is not None:
            self.kl_penalty_coef = self.beta
        if self.importance_ratio_mask is not None:
            low, high = self.importance_ratio_mask
            if not 0 <= low < 1 < high:
                raise ConfigError(f"importance_ratio_mask must be (low, high) with 0 <= low < 1 < high, got {self.importance_ratio_mask}")
        return self

    @property
    def clip_low(self) -> float:
        if self.epsilon is not None:
            return self.epsilon
        return {"ppo": 0.2, "cispo": 1.0, "gspo": 3e-4}[self.loss_fn]

    @property
    def clip_high(self) -> float:
        if self.epsilon_high is not None:
            return self.epsilon_high
        return {"ppo": self.clip_low, "cispo": 4.0, "gspo": 4e-4}[self.loss_fn]

    @property
    def aggregation(self) -> str:
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return "sequence_mean" if self.loss_fn == "gspo" else "token_mean"

    @property
    def advantage_mode(self) -> str:
        if self.advantage_normalization is not None:
            return self.advantage_normalization
        return "group" if self.normalize_advantages else "none"


class TrainSFTConfig(_CheckpointRetention):
    """Options of one supervised fine-tuning call (`model.train_sft(trajectories, config=...)`).

    The assistant messages of the trajectories are trained with cross-entropy (the mean over all
    their tokens in a batch), on the same LoRA adapter RL trains, so an SFT warm-up and RL steps
    can follow each other. One call runs `epochs` passes in batches of `batch_size`
    trajectories, one optimizer update each, and saves one checkpoint.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or NaN would poison the adapter

    learning_rate: float | list[float] = Field(default=5e-5, description="a list gives one value per batch")
    batch_size: int | Literal["auto"] = "auto"
    epochs: int = Field(default=1, ge=1)
    micro_batch_tokens: int = Field(default=16384, ge=64)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    gradient_checkpointing: bool = True
    shuffle: bool = True

    @model_validator(mode="after")
    def _check(self) -> TrainSFTConfig:
        rates = self.learning_rate if isinstance(self.learning_rate, list) else [self.learning_rate]
        if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
            raise ConfigError(f"learning_rate must be positive (or a non-empty list of positive values), got {self.learning_rate}")
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 or 'auto', got {self.batch_size}")
        return self

    def resolved_batch_size(self) -> int:
        return 8 if self.batch_size == "auto" else self.batch_size


class TrainResult(BaseModel):
    """What a train step returns: the new step number and the step's metrics.

    `num_groups` and `num_groups_trainable` count the step's groups and those with reward
    spread (None for SFT). A group whose rewards are all equal has no advantage and teaches
    nothing; when no group has spread, `is_adapter_unchanged` is True: the step still counts
    (and saves a checkpoint) but the policy is the same, so a loop can react (e.g. change the
    reward or sample more).
    """

    step: int
    metrics: dict[str, float] = Field(default_factory=dict)
    checkpoint_path: str | None = None
    num_groups: int | None = None
    num_groups_trainable: int | None = None

    @property
    def is_adapter_unchanged(self) -> bool:
        """True for an RL step in which no group had reward spread (nothing was learned)."""
        return self.num_groups_trainable == 0


def summarize_groups(groups: Iterable[TrajectoryGroup], *, split: str) -> dict[str, float]:
    """Metrics of a list of groups, keyed `<split>/<name>` (ART's history keys).

    `reward` is the mean over trajectories, `reward_std_dev` the mean within-group std,
    `exception_rate` the failed fraction of rollouts, and every numeric `trajectory.metrics`
    key is averaged over the trajectories that have it. A group's own `metrics` are averaged over
    the groups that have them as `<split>/group_<name>` (ART's keys), except costs: a
    `costs/<path>` (USD, e.g. RULER's `costs/judge/ruler`) is summed over the groups into ART's
    `costs/<split>/<path>`, with its totals `costs/<split>/<parent>` ..., `costs/<split>` and `costs/all`.
    """
    groups = list(groups)
    trajectories = [t for g in groups for t in g.trajectories]
    num_exceptions = sum(len(g.exceptions) for g in groups)
    out: dict[str, float] = {
        f"{split}/num_trajectories": float(len(trajectories)),
        f"{split}/exception_rate": num_exceptions / max(len(trajectories) + num_exceptions, 1),
    }
    if trajectories:
        out[f"{split}/reward"] = sum(t.reward for t in trajectories) / len(trajectories)
        stds = []
        for g in groups:
            rewards = g.rewards()
            if rewards:
                mean = sum(rewards) / len(rewards)
                stds.append(math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)))
        out[f"{split}/reward_std_dev"] = sum(stds) / len(stds)
    for key, values in _finite_values(t.metrics for t in trajectories).items():
        out[f"{split}/{key}"] = sum(values) / len(values)
    for key, values in _finite_values(g.metrics for g in groups).items():
        if not key.startswith("costs/"):
            out[f"{split}/group_{key}"] = sum(values) / len(values)
            continue
        parts = key.removeprefix("costs/").split("/")
        for depth in range(len(parts), -1, -1):  # costs/<split>/judge/ruler, costs/<split>/judge, costs/<split>
            total = "/".join(["costs", split, *parts[:depth]])
            out[total] = out.get(total, 0.0) + sum(values)
        out["costs/all"] = out.get("costs/all", 0.0) + sum(values)
    return out


def _finite_values(metrics: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """Each key's finite numeric values over the `metrics` dicts (a bool counts as 0 or 1)."""
    values: dict[str, list[float]] = {}
    for row in metrics:
        for key, value in row.items():
            if isinstance(value, int | float) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return values


def check_reward(reward: Any, *, where: str) -> float:
    """Return `reward` as a float; raise TrajectoryError if it is not a finite number."""
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise TrajectoryError(f"{where} has reward {reward!r}; rewards must be finite numbers (not NaN, inf or None)")
    return float(reward)


def out_of_vocabulary(token_ids: list[int], vocab_size: int) -> int | None:
    """The first id of `token_ids` outside [0, vocab_size), or None (a min and a max in the usual case)."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return None
    return next(t for t in token_ids if not 0 <= t < vocab_size)
