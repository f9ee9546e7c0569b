"""The policy-gradient step on a LoRA adapter (PEFT) of a transformers causal LM.

One `step()` is one RL step: the trajectories are split into mini-batches of `batch_size`
trajectories (one mini-batch when None), each gets one optimizer update, and each update
accumulates gradients over packed micro-batches of at most `micro_batch_tokens` tokens. Every
trained token carries a weight fixed by the loss aggregation over its whole mini-batch, so
micro-batching never changes the loss. Logprobs come from the hidden states in chunks (the
`tokens × vocab` logits never exist at once) and layers are recomputed in the backward pass
(gradient checkpointing) unless turned off. On a GPU each row's forward and backward is
replayed from a CUDA graph (cuda_graphs.py); the step's statistics stay on the device and are
read once, at its end.

If a step fails half way, the adapter, the optimizer and the RNG state are restored to what they
were before it, so the live policy always equals the last checkpoint or a complete step.

The adapter's tensors are shared with the rollout engine, which keeps sampling while a step runs
(its forward and backward only read them). Every write to them (an optimizer update, the restore
after a failure) happens inside the owner's `gate` (a lock that the engine's steps also take; on
CUDA it also orders the two streams), and the step's last update sets `gate.version`, so each
sampled token is stamped with the version of the weights that sampled it.

With a `TensorParallel` (modeling/tensor_parallel.py; the model holds this rank's shards, every rank of
the group calling `step` with the same sequences) the forward runs the rank's heads and MLP
columns, the gradients of the replicated LoRA tensors are summed over the group, the gradient
norm is the whole adapter's, and every rank takes the same optimizer step on its shards
(tensor_parallel.py: checkpoints hold the full adapter).

With a `DataParallel` (data_parallel.py; one process per GPU, every rank calling `step` with the
same sequences) each update's mini-batch is split between the ranks and the LoRA gradients are
summed over them before the identical optimizer step on every rank; the first step makes every
rank's adapter rank 0's. A step that fails on any rank is undone on every rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import torch
from torch.autograd.graph import increment_version

from ..errors import CheckpointError, ConfigError, DistributedError
from ..modeling.tensor_parallel import TensorParallel, init_row_parallel_lora_A_, lora_shard_dim
from ..types import LoRAConfig, TrainConfig
from .attention import uses_varlen
from .batching import MicroBatch, Row, RowShape, pack_sequences
from .cuda_graphs import RowGraphs
from .data_parallel import DataParallel
from .decoder import PackedDecoder
from .gemma3_decoder import Gemma3PackedDecoder
from .logprobs import selective_logprobs
from .memory_errors import memory_knob_named
from .losses import token_weights
from .moe import MoEPackedDecoder, expert_modules_of, expert_target_modules
from .objective import STATS, rl_objective
from .peft_forward import peft_forward_mode, peft_row_hidden, quiet_peft
from .step_stats import RATIO_MAX_INDEX, StepMetrics, StepTotals, combine_stats, rl_step_metrics
from .tensor_parallel import full_optimizer_state, load_sharded_adapter, save_full_adapter, shard_optimizer_state
from .tokenize import TokenizedSequence
from .undo import UndoRecord
from .work_sharing import MicroBatchClaims, SharedUpdate, run_claimed

__all__ = ["ADAPTER_NAME", "StepMetrics", "Trainer"]

ADAPTER_NAME = "default"

log = logging.getLogger("tempering")


class _NoGate:
    """The gate of a trainer that shares its weights with no engine: a version and nothing to wait for."""

    version = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Trainer:
    """Owns the PEFT model, its AdamW optimizer and the step's RNG.

    Build it with `Trainer.new(model, lora)` (a fresh adapter, B = 0 so the policy starts as the
    base model) or `Trainer.from_adapter(model, adapter_dir)` (continue from a PEFT adapter).
    The LoRA layers are injected into `model` in place, so an engine holding `model` samples
    from the live adapter with no copy.

    `gate` (keyword): a re-entrant context manager with an int `version` attribute, held around
    every in-place write to the adapter (the service's WeightsGate); by default nothing is shared.
    `dp` (keyword): train data-parallel with the other ranks of this DataParallel group; every
    rank must then make the same calls (`step`, `sft_step`) with the same arguments.

    Attributes:
        share_prompts: pack sequences with the same prompt (an RL group's) so that each row holds
            that prompt once (`pack_sequences(share_prefixes=True)`); on by default where tempering's
            own forward runs (the Llama family).
    """

    def __init__(self, peft_model: Any, lora: LoRAConfig, *, seed: int = 0, gate: Any = None,
                 dp: DataParallel | None = None, tp: TensorParallel | None = None) -> None:
        self.gate = gate if gate is not None else _NoGate()
        self.dp = dp
        self.tp = tp if tp is not None and tp.size > 1 else None
        self._is_synced = dp is None  # every rank's adapter equals rank 0's (made so by the first step)
        self.peft_model = peft_model
        self.lora = lora
        self.model = peft_model.get_base_model()  # the transformers model with LoRA layers inside
        self.named_params = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        if not self.params:
            raise ConfigError("the adapter has no trainable parameters; check LoRA target_modules")
        # fused on CUDA: one kernel for all ~400 LoRA tensors instead of a dozen multi-tensor launches
        fused = self.params[0].device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, fused=fused or None)
        self.num_updates = 0
        self.rng = random.Random(seed)
        # our own forward for the Llama family, Gemma 3 and Qwen3-MoE; None: run the transformers model (other
        # architectures)
        if self.tp is not None:
            self._check_tensor_parallel(peft_model)
            self.decoder = PackedDecoder.maybe(peft_model, ADAPTER_NAME, self.tp)
            if self.decoder is None:
                raise ConfigError("tensor parallelism trains with tempering's own Llama-family forward, which does not "
                                  f"cover {type(self.model).__name__}: use tensor_parallel_size 1")
        else:
            self.decoder = (MoEPackedDecoder.maybe(peft_model, ADAPTER_NAME)
                            or PackedDecoder.maybe(peft_model, ADAPTER_NAME)
                            or Gemma3PackedDecoder.maybe(peft_model, ADAPTER_NAME))
        log.info("training %s with %s", type(self.model).__name__,
                 f"tempering's packed forward ({type(self.decoder).__name__})" if self.decoder is not None
                 else "the transformers model's own forward (PEFT): tempering's packed forward does not cover it")
        # rows hold an RL group's shared prompt once (batching.py), with our own forward (transformers'
        # takes whole sequences); on CUDA such rows are padded and captured like any other
        self.share_prompts = self.decoder is not None
        self._checkpointing = False
        self.rows = RowGraphs(self.params, self.params[0].device)
        self._snapshot_buffers: list[torch.Tensor] | None = None  # reused by every step's snapshot
        self._undo: UndoRecord | None = None  # what a failing step restores (see _undoable)
        self._updates_this_step = 0  # optimizer updates taken by the running step
        self._num_rescored: int | None = None  # the running step's trained tokens rescored (None: no scorer)
        self._rescore_s = 0.0  # the running step's seconds in the scorer
        self._shared_rows: tuple[int, int] | None = None  # a shared update's (micro-batches, computed here)

    def _check_tensor_parallel(self, peft_model: Any) -> None:
        for name, _ in self.named_params:
            lora_shard_dim(name)  # raises for a LoRA on a module tensor parallelism does not shard
        if getattr(peft_model.peft_config[ADAPTER_NAME], "lora_dropout", 0.0):
            raise ConfigError("LoRA dropout is not supported with tensor parallelism (each rank would draw its own "
                              "mask): set LoRAConfig(dropout=0)")

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def new(cls, model: Any, lora: LoRAConfig, *, seed: int = 0, gate: Any = None,
            dp: DataParallel | None = None, tp: TensorParallel | None = None) -> Trainer:
        from peft import LoraConfig, get_peft_model

        experts = expert_target_modules(model, lora.target_modules)  # PEFT maps them onto stacked expert weights
        targets = [m for m in lora.target_modules if m in experts or any(n.endswith(m) for n, _ in model.named_modules())]
        if not targets:
            raise ConfigError(f"none of the LoRA target_modules {lora.target_modules} exist in this model")
        if experts and lora.dropout > 0:
            raise ConfigError("LoRA dropout is not supported on mixture-of-experts weights (PEFT's target_parameters); "
                              "set LoRAConfig(dropout=0)")
        config = LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
            bias="none", task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]), quiet_peft():
            torch.manual_seed(seed)  # reproducible A init (B starts at 0)
            peft_model = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
        if tp is not None and tp.size > 1:  # the sharded A's: slices of one full draw, the same on every rank
            init_row_parallel_lora_A_([(n, p) for n, p in peft_model.named_parameters() if "lora_A" in n], tp, seed)
        return cls(peft_model, lora, seed=seed, gate=gate, dp=dp, tp=tp)

    @classmethod
    def from_adapter(cls, model: Any, adapter_dir: Path, *, gate: Any = None, dp: DataParallel | None = None,
                     tp: TensorParallel | None = None) -> Trainer:
        """Continue from the PEFT adapter in `adapter_dir` (with `tp`: this rank's slices of it)."""
        from peft import PeftModel

        if tp is not None and tp.size > 1:
            with quiet_peft():
                peft_model = load_sharded_adapter(model, adapter_dir, ADAPTER_NAME, tp)
        else:
            try:
                with quiet_peft():
                    peft_model = PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=ADAPTER_NAME,
                                                           is_trainable=True)
            except Exception as exc:
                raise CheckpointError(f"could not load the LoRA adapter in {adapter_dir}: {exc}") from exc
        config = peft_model.peft_config[ADAPTER_NAME]
        targets = sorted(config.target_modules) if not isinstance(config.target_modules, str) else [config.target_modules]
        targets += [m for m in expert_modules_of(config.target_parameters) if m not in targets]
        lora = LoRAConfig(rank=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout, target_modules=targets)
        return cls(peft_model, lora, gate=gate, dp=dp, tp=tp)

    # ---- saving ---------------------------------------------------------------------------

    def save(self, directory: Path | None, *, step: int) -> None:
        """Write the adapter (PEFT format), optimizer state and trainer state (with RNG) into `directory`.

        With tensor parallelism every rank of the group must call it (the shards are gathered) and
        the rank given a directory writes the full adapter and optimizer state, as one GPU would;
        the others pass None.
        """
        if self.tp is not None:
            save_full_adapter(self.peft_model, ADAPTER_NAME, self.tp, directory)
            optimizer_state = full_optimizer_state(self.optimizer, [n for n, _ in self.named_params], self.tp)
            if directory is None:
                return
        else:
            self.peft_model.save_pretrained(str(directory), selected_adapters=[ADAPTER_NAME])
            optimizer_state = self.optimizer.state_dict()
        torch.save(optimizer_state, directory / "optimizer.pt")
        device = self.params[0].device  # the trainer's GPU only: touching the others would open a context on each
        cuda = [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []
        torch.save({"torch": torch.get_rng_state(), "cuda": cuda}, directory / "rng.pt")
        state = {
            "step": step,
            "num_updates": self.num_updates,
            "lora": self.lora.model_dump(),
            "python_rng": _jsonable(self.rng.getstate()),
        }
        (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))

    def load_state(self, directory: Path) -> None:
        """Restore the optimizer, update count and RNG state saved by `save` (what a checkpoint has;
        an older checkpoint keeps no optimizer state: its AdamW moments then start from zero).

        Raises:
            CheckpointError: naming a file that cannot be read (truncated, corrupted).
        """
        device = self.params[0].device
        path = directory / "optimizer.pt"
        if path.is_file():
            if self.tp is not None:  # the full state, as one GPU saves it: this rank's slices, cut on the host
                state = _load_file(path, map_location="cpu")
                state = shard_optimizer_state(state, [n for n, _ in self.named_params], self.tp)
            else:
                state = _load_file(path, map_location=device)
            self.optimizer.load_state_dict(state)  # moves the state to its parameters' device
        state_path = directory / "trainer_state.json"
        if state_path.is_file():
            state = json.loads(state_path.read_text())
            self.num_updates = int(state.get("num_updates", 0))
            if "python_rng" in state:
                self.rng.setstate(_tupled(state["python_rng"]))
        rng_path = directory / "rng.pt"
        if rng_path.is_file():
            rng = _load_file(rng_path)
            torch.set_rng_state(rng["torch"])
            device = self.params[0].device
            if rng["cuda"] and device.type == "cuda":  # one state, or (older checkpoints) one per visible GPU
                states = rng["cuda"]
                index = 0 if len(states) == 1 else min(device.index or 0, len(states) - 1)
                torch.cuda.set_rng_state(states[index], device)

    # ---- the step -------------------------------------------------------------------------

    def step(
        self,
        sequences: list[TokenizedSequence],
        config: TrainConfig,
        *,
        commit: Callable[[], None] | None = None,
        on_update: Callable[[dict[str, float]], None] | None = None,
        version: int | None = None,
        scorer: Callable[[list[list[int]], list[list[float]], list], list[list[float]]] | None = None,
        sharing: SharedUpdate | None = None,
    ) -> StepMetrics:
        """One RL step on sequences whose `advantage` is set.

        `commit` (say, writing the checkpoint) runs after the update; if the update or `commit`
        raises, the adapter, optimizer and RNG (and `gate.version`) are put back as they were and
        the error propagates. `on_update(info)` is called after each optimizer update with its
        index, count, loss and grad norm (progress reporting). `version`: set as `gate.version`
        together with the step's last optimizer update. `scorer(token_ids, temperatures,
        routed_experts)`: before each update, the engine's teacher-forced logprobs of each sequence's
        tokens 1..T-1 under the current weights (Engine.score; a mixture of experts routed as
        sampled, None per sequence otherwise); the objective then takes its logprobs' values from it
        and their gradient from this trainer's forward (exact on-policy with a batch-invariant
        engine). `sharing`: the step's one update is shared with other ranks, which call
        `help_update` with the same sequences (work_sharing.py; the step must have one update).

        Raises:
            ConfigError: if `sequences` is empty.
            ValueError: with `sharing`, if the step has several updates (`config.batch_size`) or a `scorer`.
            OutOfMemoryError: the device (or, on a CPU, the host) ran out of memory; the step was undone
                and the message names `config.micro_batch_tokens`, the setting that bounds its memory.
        """
        failed = True
        try:
            if not sequences:
                raise ConfigError("nothing to train on: every sequence was filtered out")
            if sharing is not None and (scorer is not None or self.count_updates(sequences, config) != 1):
                raise ValueError("a shared step has one optimizer update (config.batch_size None) and no scorer")
            longest = max(len(s.token_ids) for s in sequences)
            with memory_knob_named(config, longest_tokens=longest, device=self.params[0].device):
                metrics = self._undoable(lambda: self._step(sequences, config, on_update, version, scorer, sharing),
                                         commit)
            failed = False
            return metrics
        finally:
            if sharing is not None:  # left before its sum: release the other ranks
                self.release_shared(sharing, failed=failed)

    def release_shared(self, sharing: SharedUpdate, *, failed: bool = True) -> None:
        """Unless this rank already took part in `sharing`'s sum: take part with nothing, so that the
        ranks that share it do not wait; with `failed`, their part raises DistributedError."""
        sharing.release(self.rows.grad_buffers, len(STATS), failed=failed)

    def _undoable(self, run: Callable[[], StepMetrics], commit: Callable[[], None] | None) -> StepMetrics:
        """`_undoable_on_this_thread` with the trainer's GPU as the calling thread's current CUDA device.

        A step may run on any thread (the service's train thread, a worker rank's call thread), and
        CUDA's current device is per thread (0 unless set): Triton kernels and CUDA graphs launch
        on the current device, so a trainer on cuda:1 stepped from such a thread failed with
        "Pointer argument cannot be accessed from Triton".
        """
        device = self.params[0].device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return self._undoable_on_this_thread(run, commit)

    def _undoable_on_this_thread(self, run: Callable[[], StepMetrics], commit: Callable[[], None] | None) -> StepMetrics:
        """`run()` then `commit()`; if either raises, the adapter, optimizer and RNG go back to before.

        The RNG states are saved now; the adapter and optimizer tensors only before the first
        optimizer update changes them (`_apply_update`), so that on a GPU their copy is queued
        behind the first forward/backward instead of delaying it. With data parallelism the ranks
        vote at the end: the step stands only where it succeeded on every rank.

        Raises:
            DistributedError: when another rank's part of the step failed (this rank undid it too).
        """
        self._undo = UndoRecord(self.num_updates, self.rng.getstate(), torch.get_rng_state(), self.gate.version)
        try:
            if not self._is_synced:
                self.dp.broadcast_(self.params)  # the LoRA init or loaded adapter: rank 0's on every rank
                self._is_synced = True
            metrics = run()
            if commit is not None:
                commit()
        except Exception:
            if self.dp is not None:
                try:  # the vote that every rank casts at the end of a step, failed or not
                    self.dp.agree(False, self.params[0].device)
                except Exception as vote_error:  # a dead rank: the error raised below says what went wrong here
                    log.debug("the failed step's vote failed too: %r", vote_error)
            self._restore(self._undo)
            raise
        except BaseException:
            self._restore(self._undo)
            raise
        else:
            if self.dp is not None and not self.dp.agree(True, self.params[0].device):
                self._restore(self._undo)
                raise DistributedError("another rank failed its part of this training step (see its log); "
                                       "the step was undone on every rank")
            return metrics
        finally:
            self._undo = None

    def _step(self, sequences: list[TokenizedSequence], config: TrainConfig, on_update=None,
              version: int | None = None, scorer=None, sharing: SharedUpdate | None = None) -> StepMetrics:
        start = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = config.learning_rate
            group["weight_decay"] = config.weight_decay
        if not self.model.training:  # .train() walks every module: milliseconds per step
            self.model.train()
        self._updates_this_step, self._num_rescored = 0, 0 if scorer is not None else None
        self._rescore_s = 0.0
        self._shared_rows = None
        totals = StepTotals()
        try:
            with self._forward_mode(config.gradient_checkpointing):
                self._run_minibatches(sequences, config, totals, on_update, version, scorer, sharing)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        totals.values()  # waits for the device: the step time below is the whole step's
        return StepMetrics(rl_step_metrics(totals, config, time.perf_counter() - start, shared_rows=self._shared_rows,
                                           num_rescored=self._num_rescored, rescore_s=self._rescore_s))

    @contextlib.contextmanager
    def _forward_mode(self, checkpointing: bool) -> Iterator[None]:
        """Switch layer recomputation on for the block (also while the backward recomputes), and with
        the transformers forward, packed attention and autocast (peft_forward.py)."""
        self._checkpointing = checkpointing
        try:
            with contextlib.nullcontext() if self.decoder is not None else peft_forward_mode(self.peft_model,
                                                                                           checkpointing):
                yield
        finally:
            self._checkpointing = False

    def _objective_key(self, config: TrainConfig, scorer: bool) -> tuple:
        """Everything the captured objective depends on besides the row's shape."""
        return (config.loss_fn, config.clip_low, config.clip_high, config.truncated_importance_sampling,
                config.decoupled, config.importance_ratio_mask, config.kl_penalty_coef, config.kl_estimator,
                config.logprob_chunk_size, self._checkpointing, scorer)

    def _run_minibatches(self, sequences: list[TokenizedSequence], config: TrainConfig, totals: StepTotals,
                         on_update=None, version: int | None = None, scorer=None,
                         sharing: SharedUpdate | None = None) -> None:
        minibatches = self._minibatches(sequences, config)
        capture = self._can_capture(config)
        key = self._objective_key(config, scorer is not None)
        objective = lambda row: rl_objective(self._row_logprobs, row, config)
        failure: Exception | None = None  # of this rank, carried to the next collective (data_parallel.py)
        for index, minibatch in enumerate(minibatches):
            weights = token_weights(minibatch, config.aggregation, config.dr_grpo_normalizer)
            totals.tokens += sum(len(s) for s in minibatch)
            stats = self._accumulate(minibatch, weights, config.micro_batch_tokens, objective, key, capture=capture,
                                     failure=failure, num_stats=len(STATS), max_index=RATIO_MAX_INDEX, scorer=scorer,
                                     sharing=sharing)
            if stats is not None:
                totals.add(stats)
            try:
                grad_norm = self._apply_update(config.max_grad_norm,
                                               publish=version if index == len(minibatches) - 1 else None)
                if math.isfinite(grad_norm):
                    totals.grad_norms.append(grad_norm)
                else:
                    totals.num_skipped += 1
                    log.warning("update %d of %d had a non-finite gradient norm (%s) and was skipped: the adapter "
                                "is unchanged by it (metric loss/num_updates_skipped)", index + 1, len(minibatches),
                                grad_norm)
                if on_update is not None:  # this update's loss (the step's metric is their mean)
                    loss = float(stats[STATS.index("loss")]) if stats is not None else 0.0
                    on_update({"update": index + 1, "num_updates": len(minibatches), "grad_norm": float(grad_norm),
                               "loss": loss})
            except Exception as exc:
                if self.dp is None:
                    raise
                failure = exc  # raised at the next collective (the next update's, or the step's vote)
        if failure is not None:
            raise failure

    def help_update(self, sequences: list[TokenizedSequence], config: TrainConfig, sharing: SharedUpdate,
                    may_claim: Callable[[], bool]) -> int:
        """A serving rank's part of another rank's shared update (work_sharing.py): claim micro-batches
        of `sequences` (those of that rank's `step(sequences, config, sharing=...)`, on the same
        adapter) while `may_claim()` holds, add their gradients to the group's sum, and leave this
        trainer's adapter, optimizer and `.grad` as they were. Returns the micro-batches computed here.

        Raises:
            DistributedError: when another rank's part failed (this rank's own error propagates).
            OutOfMemoryError: this rank ran out of memory computing its micro-batches; names the knob.
        """
        device = self.params[0].device
        longest = max((len(s.token_ids) for s in sequences), default=0)
        with (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(),
              memory_knob_named(config, longest_tokens=longest, device=device)):
            objective = lambda row: rl_objective(self._row_logprobs, row, config)
            self._shared_rows = None
            try:
                if not self.model.training:
                    self.model.train()
                weights = token_weights(sequences, config.aggregation, config.dr_grpo_normalizer)
                with self._forward_mode(config.gradient_checkpointing):
                    self._accumulate(sequences, weights, config.micro_batch_tokens, objective,
                                     self._objective_key(config, False), capture=self._can_capture(config),
                                     failure=None, num_stats=len(STATS), max_index=RATIO_MAX_INDEX, sharing=sharing,
                                     may_claim=may_claim)
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                self.release_shared(sharing)  # left before the sum (it raised): stop the others
        return self._shared_rows[1] if self._shared_rows is not None else 0

    def _accumulate(self, sequences: list[TokenizedSequence], weights: list[float], max_tokens: int,
                    objective: Callable[[Row], tuple[torch.Tensor, torch.Tensor]], key: Any, *, capture: bool,
                    failure: Exception | None, num_stats: int, max_index: int | None,
                    scorer=None, sharing: SharedUpdate | None = None,
                    may_claim: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """One update's gradient of `sequences` into the accumulators, installed as the parameters'
        `.grad`; returns the update's statistics ([num_stats] sums; None: no row trained anything).

        With data parallelism this rank runs only its share of the sequences, with `sharing` only
        the micro-batches it claims (`may_claim`: a serving rank's condition, see work_sharing.py);
        the gradients and statistics are then summed over the ranks (`max_index`: the statistic
        that is a max), and a failure on any rank (`failure`, this rank's from earlier in the step,
        or one raised here) is raised on every rank, as DistributedError on the others. Without,
        errors propagate.
        """
        self.optimizer.zero_grad(set_to_none=True)
        self.rows.begin_update()
        stats = None
        group = sharing.group if sharing is not None else self.dp
        if self.dp is not None:
            mine = self.dp.shard([len(s) for s in sequences])
            sequences, weights = [sequences[i] for i in mine], [weights[i] for i in mine]
        try:
            if failure is None:
                if scorer is not None:
                    began = time.perf_counter()
                    self._num_rescored += _attach_exact_logprobs(sequences, scorer,
                                                                 weights_changed=self._updates_this_step > 0)
                    self._rescore_s += time.perf_counter() - began
                micros = pack_sequences(sequences, max_tokens=max_tokens, weights=weights,
                                        share_prefixes=self.share_prompts)

                def run(index: int) -> None:
                    nonlocal stats
                    micro = micros[index]
                    if micro.loss_mask[0, 1:].any():  # else nothing is trained in this row
                        stats = combine_stats(stats, self.rows.run(micro, objective, key, capture=capture), max_index)

                if sharing is None:
                    for index in range(len(micros)):
                        run(index)
                else:
                    claims = MicroBatchClaims(sharing.store, sharing.key, len(micros))
                    run_claimed(claims, run, device=self.params[0].device, may_claim=may_claim,
                                poll_s=sharing.poll_s)
                    self._shared_rows = (len(micros), claims.num_claimed)
        except Exception as exc:
            if group is None:
                raise
            failure = exc
        if group is not None:
            local = stats if stats is not None else torch.zeros(num_stats, device=self.params[0].device)
            if sharing is not None:
                sharing.reduced = True  # this rank's one try (a dead rank's error must not bring a second)
            stats, num_failed = group.reduce_update(self.rows.grad_buffers, local, failed=failure is not None,
                                                    max_index=max_index)
            if sharing is not None and group.rank == 0:  # every rank is past its claims
                sharing.close()
            if failure is not None:
                raise failure
            if num_failed:
                raise DistributedError(f"{num_failed} other rank(s) failed their part of this training step "
                                       "(see their log); the step was undone on every rank")
        self.rows.install_grads()
        if self.tp is not None:  # each rank holds a partial sum of the replicated tensors' gradients
            self.tp.all_reduce_replicated_grads(self.named_params)
        return stats

    def _can_capture(self, config: TrainConfig) -> bool:
        """CUDA graphs for the rows: on CUDA, with tempering's own forward, PyTorch's varlen attention
        (torch >= 2.10, half precision; the fallback loops over sequences on the host) and no LoRA
        dropout."""
        # not under tensor parallelism: its collectives in captured rows are not validated yet
        return (config.cuda_graphs and self.decoder is not None and not self.decoder.has_dropout and self.tp is None
                and uses_varlen(self.model.get_input_embeddings().weight))

    def sft_step(
        self,
        batches: list[tuple[list[TokenizedSequence], float]],
        config: Any,
        *,
        commit: Callable[[], None] | None = None,
        on_update: Callable[[dict[str, float]], None] | None = None,
        version: int | None = None,
    ) -> StepMetrics:
        """Supervised updates: each (sequences, learning rate) batch is one optimizer update of the
        mean cross-entropy over its trained tokens. `config` is a TrainSFTConfig. Undone on failure,
        and `version` published with the last update, like `step`.

        Raises:
            OutOfMemoryError: the device ran out of memory (the update was undone); names the knob.
        """
        longest = max((len(s.token_ids) for sequences, _ in batches for s in sequences), default=0)
        with memory_knob_named(config, longest_tokens=longest, device=self.params[0].device):
            return self._undoable(lambda: self._sft(batches, config, on_update, version), commit)

    def _sft(self, batches, config, on_update, version=None) -> StepMetrics:
        start = time.perf_counter()
        if not self.model.training:
            self.model.train()

        def objective(row: Row) -> tuple[torch.Tensor, torch.Tensor]:
            logprobs, _ = self._row_logprobs(row)
            loss = -(logprobs * row.weights).sum()
            return loss, torch.stack([loss.detach(), loss.new_tensor(float(logprobs.numel()))])

        losses, grad_norms, tokens, trained = [], [], 0, 0
        failure: Exception | None = None
        try:
            with self._forward_mode(config.gradient_checkpointing):
                for index, (batch, learning_rate) in enumerate(batches):
                    for group in self.optimizer.param_groups:
                        group["lr"] = learning_rate
                        group["weight_decay"] = 0.0
                    weights = token_weights(batch, "token_mean", None)
                    tokens += sum(len(s) for s in batch)
                    stats = self._accumulate(batch, weights, config.micro_batch_tokens, objective, "sft", capture=False,
                                             failure=failure, num_stats=2, max_index=None)
                    batch_loss, batch_trained = stats.tolist() if stats is not None else (0.0, 0.0)
                    trained += int(batch_trained)
                    try:
                        grad_norm = self._apply_update(config.max_grad_norm,
                                                       publish=version if index == len(batches) - 1 else None)
                        losses.append(batch_loss)
                        if math.isfinite(grad_norm):
                            grad_norms.append(grad_norm)
                        else:
                            log.warning("SFT batch %d of %d had a non-finite gradient norm (%s) and was skipped",
                                        index + 1, len(batches), grad_norm)
                        if on_update is not None:
                            on_update({"update": index + 1, "num_updates": len(batches), "loss": batch_loss,
                                       "grad_norm": float(grad_norm)})
                    except Exception as exc:
                        if self.dp is None:
                            raise
                        failure = exc  # raised at the next collective (see _run_minibatches)
            if failure is not None:
                raise failure
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        return StepMetrics({
            "sft/loss": sum(losses) / len(losses),
            "sft/loss_first_batch": losses[0],
            "sft/loss_last_batch": losses[-1],
            "sft/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "sft/num_updates_skipped": float(len(batches) - len(grad_norms)),
            "sft/num_updates": float(len(batches)),
            "sft/tokens": float(tokens),
            "sft/trained_tokens": float(trained),
            "time/sft_s": elapsed,
        })

    def _apply_update(self, max_grad_norm: float | None, *, publish: int | None = None) -> float:
        """Clip the gradients, take an optimizer step; returns the norm before clipping.

        The optimizer step is the only write to the shared adapter: it alone holds the gate, and
        `publish` (when given) becomes `gate.version` in the same hold. A non-finite norm (inf or
        nan) skips the update: nothing is written, and the caller reports it.
        """
        self._save_tensors()
        if self.tp is not None:  # the whole adapter's norm, the same on every rank of the group
            grad_norm = self.tp.grad_norm(self.named_params)
            if max_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(self.params, max_grad_norm, grad_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params,
                                                       max_grad_norm if max_grad_norm is not None else math.inf)
        if not torch.isfinite(grad_norm):  # skipped, as AMP's GradScaler skips an overflowed step
            for p in self.params:
                p.grad = None
            return float(grad_norm)
        with self.gate:
            self.optimizer.step()
            self._updates_this_step += 1
            # readers of the adapter key their copies on tensor version counters (the engine's spare
            # rows and B^T shadows), which a fused optimizer's in-place writes do not bump
            for p in self.params:
                increment_version(p)
            if publish is not None:
                self.gate.version = publish
        self.num_updates += 1
        return float(grad_norm)

    def _minibatches(self, sequences: list[TokenizedSequence], config: TrainConfig) -> list[list[TokenizedSequence]]:
        """Whole trajectories per mini-batch, shuffled (with the saved RNG) when there are several."""
        trajectories = _by_trajectory(sequences)
        size = config.batch_size or len(trajectories)
        if size < len(trajectories):
            self.rng.shuffle(trajectories)
        minibatches = [sum(trajectories[i:i + size], []) for i in range(0, len(trajectories), size)]
        return [m for m in minibatches if any(s.num_completion_tokens for s in m)]

    @staticmethod
    def count_updates(sequences: list[TokenizedSequence], config: TrainConfig) -> int:
        """How many mini-batches (optimizer updates) `step(sequences, config)` splits the sequences
        into, counting any with nothing to train; the RNG is not touched."""
        count = len(_by_trajectory(sequences))
        return -(-count // (config.batch_size or max(count, 1)))

    def _logprobs(self, micro: MicroBatch, chunk_size: int = 1024, *, lora: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [N] and entropies [N] of a packed row's trained tokens, in row order."""
        # under TP the row's tokens divide by the group (sequence parallelism splits them evenly)
        tp_size = self.tp.size if self.tp is not None else 1
        shape = RowShape.padded(micro, tp_size) if micro.num_tokens % tp_size else None
        return self._row_logprobs(micro.row(shape).to(self.params[0].device), chunk_size, lora=lora)

    def _row_logprobs(self, row: Row, chunk_size: int = 1024, *, lora: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [N] and entropies [N] of the row's predictions; `lora=False`: the base model's."""
        h = self._row_hidden(row, lora)[row.pred_positions]  # [N, H]
        weight = self.model.get_output_embeddings().weight
        return selective_logprobs(h, weight, row.targets, row.temperature, chunk_size=chunk_size)

    def _row_hidden(self, row: Row, lora: bool) -> torch.Tensor:
        """Final hidden states [T, H] of a row (`lora=False`: the base model's)."""
        if self.decoder is not None:
            moe = isinstance(self.decoder, MoEPackedDecoder) and row.routed_experts is not None
            replay = {"routed_experts": row.routed_experts} if moe else {}  # the experts the sampler routed to
            return self.decoder(row.input_ids, row.position_ids, row.cu_seq_lens, row.max_seq_len, keys=row.keys,
                                lora=lora, checkpointing=self._checkpointing, **replay)
        return peft_row_hidden(self.peft_model, row, lora=lora)

    # ---- failure safety -------------------------------------------------------------------

    def _save_tensors(self) -> None:
        """Copy the adapter and the optimizer state into the pending undo record (once per step)."""
        if self._undo is not None:
            self._snapshot_buffers = self._undo.save_tensors(self.params, self.optimizer, self._snapshot_buffers)

    def _restore(self, undo: UndoRecord) -> None:
        self.num_updates = undo.num_updates
        self.rng.setstate(undo.python_rng)
        torch.set_rng_state(undo.torch_rng)
        if undo.restore_tensors(self.params, self.optimizer, self.gate):
            self._snapshot_buffers = None  # the saved moments became the optimizer's own tensors


def _by_trajectory(sequences: list[TokenizedSequence]) -> list[list[TokenizedSequence]]:
    """The sequences of each trajectory, in order of first appearance."""
    by_trajectory: dict[tuple[int, int], list[TokenizedSequence]] = {}
    for s in sequences:
        by_trajectory.setdefault((s.group_index, s.trajectory_index), []).append(s)
    return list(by_trajectory.values())


def _attach_exact_logprobs(sequences: list[TokenizedSequence], scorer, *, weights_changed: bool) -> int:
    """Set each sequence's `exact_logprobs`: its trained tokens' logprobs under the current weights
    by the batch-invariant engine, nan elsewhere; returns how many trained tokens were rescored.

    A sequence sampled with these very weights (`on_policy`, while no update of this step has
    changed them) keeps its sampled logprobs: the engine would recompute the same bits (its batch
    invariance; tests/engine/test_batch_invariant.py and benchmarks/logprob_agreement.py check it).
    The others are rescored by `scorer` (the engine's teacher-forced forward, Engine.score), a
    mixture of experts routed as each sequence was sampled (its `routed_experts`, which the trainer
    replays): the value and the gradient are then of one function.
    """
    rescore = []
    for seq in sequences:
        if seq.on_policy and not weights_changed:
            seq.exact_logprobs = list(seq.sampled_logprobs)
        else:
            rescore.append(seq)
    if not rescore:
        return 0
    scores = scorer([s.token_ids for s in rescore], [s.temperatures for s in rescore],
                    [s.routed_experts for s in rescore])  # a mixture of experts: the routing the trainer replays
    for seq, values in zip(rescore, scores):
        seq.exact_logprobs = [math.nan] + [v if trained else math.nan for v, trained in zip(values, seq.loss_mask[1:])]
    return sum(s.num_completion_tokens for s in rescore)


def _load_file(path: Path, **options: Any) -> Any:
    """`torch.load(path, weights_only=True)`, a file that cannot be read named in a CheckpointError."""
    try:
        return torch.load(path, weights_only=True, **options)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(exc).__name__}: {exc}); it is truncated "
                              f"or corrupted. Delete {path.parent} to resume from the checkpoint before it") from exc


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
