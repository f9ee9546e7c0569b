"""ModelService: one trainable model's base weights, engine, trainer and checkpoints.

The base weights are loaded once. The trainer injects LoRA layers into that same module tree,
and the engine samples from it, so a finished step is served at once, with no copy and no
reload.

Rollouts keep running while a training step runs: the step's forward and backward only read the
shared tensors, and only its writes (the optimizer update, a restore after a failure) and changes
of the module tree (the first step's LoRA injection, loading a saved step's adapter) exclude
engine steps, through the `WeightsGate`, which also carries the policy version stamped on every
sampled token. On CUDA the trainer runs on a stream of its own, ordered against the engine's by
the gate's events. With a transformers fallback (the engine or the trainer of an architecture
tempering has no model code for), which share module state with each other, a training step holds
the gate from start to end instead, as before.

In a multi-GPU run (one process per GPU) every rank holds a ModelService of the model: its own
copy of the base weights, its engine replica and its trainer, whose adapters the data-parallel
step keeps identical (training/data_parallel.py). Rank 0's service (the driver's) is the one the
HTTP routes reach: it balances generation requests over the replicas (parallel/router.py), sends
each training call to the other ranks' services (`follow_train`) before taking its own part, and
alone writes checkpoints.

Tensor parallelism (`EngineConfig.tensor_parallel_size` = P > 1): the model is split over P
ranks (modeling/tensor_parallel.py). Every rank loads only its shards (parallel/shard_load.py), its engine
and trainer share them; the engine of the group's first rank leads (it schedules, samples and
takes the requests) and the others' follow it; every rank takes the same training step on its
shards, and rank 0 writes the full adapter. A training call pauses the replica's engine (its
collectives and the engine's must come in one order on every rank: `Engine.pause_followers`).
With GPUs = replicas x P, ranks [kP, (k+1)P) hold replica k, rank 0 routes requests to the
replicas' leaders, and the ranks that hold the same shard in every replica train data-parallel.

Dedicated mode (ART's `trainer_gpu_ids=[0]`, `inference_gpu_ids=[1, ...]`; `dedicated=True`) splits
the roles instead: rank 0 trains alone (its engine serves nothing) and the other ranks serve alone,
so decoding never waits for a training step on the same GPU. After every training call rank 0
broadcasts the adapter's tensors (the LoRA only, never the base); each serving rank receives them
beside its engine's steps and swaps them in between two steps (`receive_adapter`), with the new
policy version.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..chat import ChatRenderer, TurnCache
from ..engine import Engine, EngineConfig, HFEngine, Policy, SamplingParams, engine_model_for
from ..engine.grammar import GrammarCompiler
from ..engine.cpu_threads import run_in_own_thread
from ..engine.memory import release_free_memory
from ..engine.models import fallback_reason
from ..errors import ConfigError, DistributedError, TrajectoryError, UnknownModelError
from ..parallel import Router, WorkerLink
from ..parallel.shard_load import dummy_model, load_llama_shards
from ..modeling.tensor_parallel import TensorParallel
from ..storage import ModelPaths, append_history, list_checkpoints, verify_checkpoint, write_atomically, write_trajectories
from ..storage.checkpoints import is_complete
from ..training import TokenizedSequence, Trainer
from ..training.data_parallel import DataParallel
from ..training.policy_age import policy_age_metrics
from ..training.rl_batch import in_vocabulary, rl_batch
from ..training.sft import sft_batches, sft_sequences
from ..training.trainer import ADAPTER_NAME
from ..training.work_sharing import SharedUpdate
from ..types import (
    LoRAConfig,
    TrainConfig,
    TrainResult,
    TrainSFTConfig,
    TrajectoryGroup,
    summarize_groups,
)
from .base_model import check_fits_device, default_dtype, resolve_base_model
from .checkpoint_care import resume_point, tidy_checkpoints
from .policies import AdapterPolicy, LivePolicy, NoAdapterPolicy
from .weights_gate import WeightsGate

__all__ = ["ModelService"]

log = logging.getLogger("tempering")

# what the GPU path serves: half precision at full speed; float32 with IEEE float32 products on both
# sides (TF32 only under torch.set_float32_matmul_precision("high")), prefill and training attention
# by SDPA, no CUDA graphs in training: a small model's default, whose engine and trainer agree as on a CPU
CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_named(name: str | None) -> torch.dtype | None:
    """The torch dtype of a model dtype's name, as a hub or a registration takes it ("bfloat16",
    "float16", "float32"); None for None (the device's default).

    Raises:
        ConfigError: for any other name.
    """
    if name is None:
        return None
    if name not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"dtype {name!r} is not a torch dtype a model runs in; use bfloat16, float16 or float32")
    return getattr(torch, name)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class ModelService:
    """Serves and trains one model.

    Args:
        paths: where the model's state lives on disk.
        base_model: see `resolve_base_model`.
        lora: the adapter's LoRA config (defaults to `LoRAConfig()`); a checkpoint's own config wins.
        device: defaults to CUDA when available, else CPU.
        dtype: defaults to `default_dtype`: float32 on CPU (bf16 matmuls are slow on most CPUs); on
            CUDA float32 for a model of at most 0.5B parameters (engine and trainer then agree to
            ~1e-5 nats), else bfloat16. On CUDA the dtypes of CUDA_DTYPES (float32 not with
            `EngineConfig.batch_invariant`).
        max_batch_size: most samples the engine decodes together.
        engine_config: batching and KV-cache settings of the engine.
        max_seq_len: longest sequence (prompt + completion) served and trained, in tokens;
            default and upper bound: the model's context length.
        dp: in a multi-GPU run, this rank's DataParallel group (every rank has a service).
        workers: on rank 0 of a multi-GPU run, the channels to the other ranks, whose services
            of the same name were registered with the same arguments.
        dedicated: in a multi-GPU run, rank 0 trains and the other ranks serve (see above).
        on_run_failure: under tensor parallelism, called with a DistributedError (from the engine's
            thread) when this rank's engine fails: the other ranks of its group then wait for it
            in a collective, so the run must stop (rank 0: `Driver.fail`; a worker: it exits).

    Raises:
        UnknownModelError: if `base_model` cannot be resolved.
        ConfigError: if the weights (this GPU's shards of them) do not fit the GPU, `dedicated`
            without a multi-GPU run, a `dtype` the GPU path does not serve (float64, or float32 with
            `EngineConfig.batch_invariant` on CUDA), or a tensor_parallel_size other than the run's
            number of processes.
    """

    def __init__(
        self,
        paths: ModelPaths,
        base_model: str,
        *,
        lora: LoRAConfig | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 256,
        engine_config: EngineConfig | None = None,
        cache_dir: Path | None = None,
        max_seq_len: int | None = None,
        dp: DataParallel | None = None,
        workers: list[WorkerLink] | tuple[WorkerLink, ...] = (),
        dedicated: bool = False,
        on_run_failure: Callable[[DistributedError], None] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_seq_len is not None and max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be at least 2 tokens, got {max_seq_len}")
        self.paths = paths
        self.base_model = base_model
        self._on_run_failure = on_run_failure
        self.lora = lora or LoRAConfig()
        self.device = torch.device(device) if device is not None else default_device()
        engine_config = engine_config or EngineConfig(max_num_seqs=max_batch_size)
        if self.device.type == "cuda" and dtype is not None and dtype not in CUDA_DTYPES:
            raise ConfigError(f"dtype {dtype} is not served on a GPU: use torch.bfloat16, torch.float16 or "
                              "torch.float32 (exact, slower; the default up to 0.5B parameters)")
        if dedicated and (dp is None or dp.world_size < 2):
            raise ConfigError("dedicated mode (a training GPU and serving GPUs) needs a multi-GPU run: "
                              "LocalBackend(gpus=N) or `tempering serve --gpus N` with N >= 2")
        if self.device.type == "cuda" and dtype == torch.float32 and engine_config.batch_invariant:
            raise ConfigError("EngineConfig(batch_invariant=True) runs half-precision kernels on a GPU; with dtype "
                              "torch.float32 the engine and the trainer already sum in float32 throughout: "
                              "drop one of the two")
        self.tp = None
        if engine_config.tensor_parallel_size > 1:  # replicas of P ranks; dp: the same shard's ranks across them
            self.tp, dp = self._tensor_parallel(engine_config.tensor_parallel_size, dp, dedicated)
        self.dedicated = dedicated
        self._writes_checkpoints = (dp is None or dp.rank == 0) and (self.tp is None or self.tp.is_leader)
        # dedicated: the adapter travels over the whole group; the trainer itself is rank 0's alone
        self._adapter_group = dp if dedicated else None
        self.dp = None if dedicated else dp
        # whether this rank's engine takes requests (a tensor-parallel follower runs the leader's)
        self.serves = (not dedicated or dp.rank != 0) and (self.tp is None or self.tp.is_leader)
        self.workers = list(workers)
        resolved = resolve_base_model(base_model, cache_dir=cache_dir)
        self.dtype = dtype or default_dtype(resolved.model_ref, self.device, batch_invariant=engine_config.batch_invariant,
                                            tensor_parallel_size=engine_config.tensor_parallel_size)
        check_fits_device(resolved.model_ref, self.dtype, self.device,
                          tensor_parallel_size=engine_config.tensor_parallel_size)
        self.tokenizer = AutoTokenizer.from_pretrained(resolved.model_ref)
        if engine_config.load_format == "dummy":  # random weights from the config (a shape's benchmark)
            self.model = dummy_model(resolved.model_ref, self.device, self.dtype, tp=self.tp)
        elif self.tp is not None:  # this rank's shards only, read slice by slice
            self.model = load_llama_shards(resolved.model_ref, self.tp, self.device, self.dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(resolved.model_ref, dtype=self.dtype).to(self.device)
        self.model.requires_grad_(False)
        self.max_seq_len = int(getattr(self.model.config, "max_position_embeddings", 4096) or 4096)
        if max_seq_len is not None:
            self.max_seq_len = min(self.max_seq_len, int(max_seq_len))
        stop_ids = self.model.generation_config.eos_token_id
        stop_ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids or [])
        self.renderer = ChatRenderer(self.tokenizer, stop_token_ids=stop_ids)
        self.turns = TurnCache(self.tokenizer)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]  # the logits' width
        self.grammars = GrammarCompiler(self.tokenizer, stop_token_ids=self.renderer.stop_token_ids,
                                        vocab_size=self.vocab_size, end_of_turn_id=self.renderer.end_of_turn_id)

        self.trainer: Trainer | None = None
        # the newest checkpoint whose files are whole; rank 0 also clears what a killed run left half done
        resume = resume_point(paths, repair=self._writes_checkpoints)
        self.step = resume.step if resume is not None else 0
        # engine steps and writes of the shared weights; the policy version is the step
        self.gate = WeightsGate(self.device, version=self.step)
        # one training call at a time; also excludes loading a step's adapter (PEFT's module tree changes)
        self.train_lock = threading.RLock()
        self._train_stream: torch.cuda.Stream | None = None  # the trainer's CUDA stream (made on first use)
        self._helpers_step: int | None = None  # dedicated rank 0: the step whose adapter the serving ranks hold
        if resume is not None:
            self.trainer = Trainer.from_adapter(self.model, resume.path, gate=self.gate, dp=self.dp, tp=self.tp)
            self.trainer.load_state(resume.path)
        elif resolved.adapter_dir is not None:  # continue from a PEFT adapter: it is step 0
            self.trainer = Trainer.from_adapter(self.model, resolved.adapter_dir, gate=self.gate, dp=self.dp,
                                                tp=self.tp)
            self._save(self.trainer, paths.checkpoint(0), 0)
        self._live = LivePolicy(lambda: self.trainer is not None, self.gate)
        self._step_adapters: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._step_adapters_lock = threading.Lock()
        self._max_step_adapters = 4
        if dedicated and not self.serves:  # dedicated rank 0: an engine for completeness, with a token KV cache
            engine_config = dataclasses.replace(engine_config, num_kv_blocks=64, cpu_kv_cache_bytes=8 << 20,
                                                max_num_seqs=min(engine_config.max_num_seqs, 16), use_cuda_graphs=False)
        self.engine = self._make_engine(engine_config)
        # rank 0 of a multi-GPU run: requests balanced over its own engine (unless dedicated) and the other ranks'
        remote = [lambda *a, link=link, **k: self._submit_remote(link, *a, **k) for link in self.workers]
        if self.tp is not None:  # one engine per replica, led by its TP rank 0
            remote = [submit for submit, link in zip(remote, self.workers) if link.rank % self.tp.size == 0]
        self.router = Router([*([self._submit_local] if self.serves else []), *remote]) if remote else None

    @staticmethod
    def _tensor_parallel(size: int, dp: DataParallel | None,
                         dedicated: bool) -> tuple[TensorParallel, DataParallel | None]:
        """(this rank's tensor-parallel group, its data-parallel group or None) when the run's ranks
        are split into replicas of `size` consecutive ranks (GPUs = replicas x size); every rank of
        the run creates them at registration (a collective).

        Raises:
            ConfigError: if the run's processes are not a multiple of `size`, or with `dedicated`.
        """
        world = dp.world_size if dp is not None else 1
        if world % size:
            raise ConfigError(f"tensor_parallel_size {size} splits the model over {size} GPUs, but this run has "
                              f"{world}: start it on a multiple of {size} (LocalBackend(gpus={size}) or "
                              "`tempering serve --gpus "
                              f"{size}`; 2 x {size} GPUs for two replicas)")
        if dedicated:
            raise ConfigError("dedicated mode (a training GPU and serving GPUs) does not combine with tensor "
                              "parallelism")
        tp, data_group = TensorParallel.split(size)
        return tp, DataParallel(data_group) if data_group is not None else None

    def _save(self, trainer: Trainer, checkpoint: Path, step: int) -> None:
        """Write `checkpoint` (rank 0); under tensor parallelism every rank takes part (the shards are gathered)."""
        if self._writes_checkpoints:
            write_atomically(checkpoint, lambda tmp: trainer.save(tmp, step=step))
        elif self.tp is not None:
            trainer.save(None, step=step)

    def _tidy_checkpoints(self, step: int, config: TrainConfig | TrainSFTConfig) -> None:
        """After checkpoint `step` was saved (rank 0): older checkpoints' optimizer state goes, and the
        retention of `config` applies (checkpoint_care.py); the live step always stays."""
        if self._writes_checkpoints:
            tidy_checkpoints(self.paths, step, config, live_step=self.step)

    def _make_engine(self, config: EngineConfig) -> Engine | HFEngine:
        """tempering's engine when it has model code for the architecture, else the transformers one
        (a log line says which serves the model, and why)."""
        arch = type(self.model).__name__
        reason = fallback_reason(self.model, self.max_seq_len)
        if reason is None or config.batch_invariant:  # a fallback cannot be batch-invariant: engine_model_for says so
            decoder = engine_model_for(self.model, self.max_seq_len, batch_invariant=config.batch_invariant, tp=self.tp)
        else:
            decoder = None
        if decoder is None and self.tp is not None:
            raise ConfigError(f"tensor parallelism runs tempering's Llama-family engine, which does not cover {arch} "
                              f"({reason}): use tensor_parallel_size 1")
        if decoder is None:
            log.warning("%s (%s, %s): served by the transformers fallback engine (HFEngine, static batches), "
                        "because %s", self.paths.name, self.base_model, arch, reason)
            return HFEngine(
                self.model,
                self.tokenizer,
                stop_token_ids=self.renderer.stop_token_ids,
                lock=self.gate,
                max_batch_size=min(config.max_num_seqs, 64),
                max_seq_len=self.max_seq_len,
            )
        log.info("%s (%s, %s): served by tempering's engine (%s: paged KV cache, continuous batching, live LoRA)",
                 self.paths.name, self.base_model, arch, type(decoder).__name__)
        return Engine(
            decoder,
            self.tokenizer,
            stop_token_ids=self.renderer.stop_token_ids,
            lock=self.gate,
            config=config,
            max_seq_len=self.max_seq_len,
            peft_model=lambda: self.peft_model,
            on_group_failure=self._engine_group_failed if self.tp is not None else None,
        )

    def _engine_group_failed(self, exc: BaseException) -> None:
        """This rank's tensor-parallel engine failed (Engine's `on_group_failure`): stop the run."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        error = DistributedError(
            f"the tensor-parallel engine of {self.paths.name!r} failed on rank {rank} ({type(exc).__name__}: {exc}); "
            f"the other ranks of its group wait for it in a collective, so this multi-GPU run cannot go on. "
            f"{'See the error above, then start' if rank else 'Start'} the backend again: it resumes from the last "
            f"checkpoint")
        if self._on_run_failure is not None:
            self._on_run_failure(error)

    @property
    def peft_model(self) -> Any:
        return self.trainer.peft_model if self.trainer is not None else None

    # ---- inference --------------------------------------------------------------------------

    def policy(self, step: int | None = None) -> Policy:
        """The policy of `step`; None: the live one, which the trainer updates in place.

        A saved step is served from its checkpoint, loaded beside the live adapter on first use, so
        it stays that step's weights while training goes on. Loading waits for a running training
        step to end (it changes PEFT's module tree): call it off the event loop for a new step.

        Raises:
            UnknownModelError: if there is no checkpoint of `step`.
            CheckpointError: if a file of its adapter is damaged (named in the message).
        """
        if step is None:
            return self._live
        checkpoint = self.paths.checkpoint(step)
        if not self._is_saved(step):
            if step == 0:
                return NoAdapterPolicy(lambda: self.peft_model)
            return self._live  # trained with save_checkpoint=False: only the live weights are that step's
        if self.tp is not None:
            if step == self.step:  # the live adapter is that step's
                return self._live
            raise ConfigError(f"serving saved step {step} beside the live adapter is not supported under tensor "
                              f"parallelism yet; the latest step ({self.step}) is served")
        with self._step_adapters_lock:
            name = self._step_adapters.get(step)
            if name is not None:
                self._step_adapters.move_to_end(step)
                return AdapterPolicy(self.trainer.peft_model, name, step)
        with self.train_lock, self.gate:  # neither a training step's forward nor an engine step sees it half-built
            with self._step_adapters_lock:
                name = self._step_adapters.get(step)
            if name is None:
                name = f"step-{step:04d}"
                verify_checkpoint(checkpoint, training_state=False)  # a damaged file is named, never loaded
                run_in_own_thread(self.peft_model.load_adapter, str(checkpoint), adapter_name=name, is_trainable=False)
                self.peft_model.set_adapter(ADAPTER_NAME)
                with self._step_adapters_lock:
                    self._step_adapters[step] = name
                    evicted = self._evictable_step_adapter() if len(self._step_adapters) > self._max_step_adapters else None
                if evicted is not None:
                    self.peft_model.delete_adapter(evicted)
                    if isinstance(self.engine, Engine):
                        self.engine.forget_adapter(evicted)
        return AdapterPolicy(self.trainer.peft_model, name, step)

    def _evictable_step_adapter(self) -> str | None:
        """Pop and return the least recently used saved-step adapter that no queued or running
        request samples with; None when every one is in use (the cap is then exceeded until a later
        load finds one free). Call under `_step_adapters_lock` with the engine held (`gate`)."""
        in_use = getattr(self.engine, "adapter_in_use", lambda name: False)
        for step, name in list(self._step_adapters.items())[:-1]:  # never the one just loaded
            if not in_use(name):
                del self._step_adapters[step]
                return name
        return None

    def _is_saved(self, step: int) -> bool:
        """Whether `step` has a checkpoint; False for step 0 without one, or the latest step trained
        with save_checkpoint=False (both served anyway).

        Raises:
            UnknownModelError: for any other step without a checkpoint.
        """
        if is_complete(self.paths.checkpoint(step)):
            return True
        if step in (0, self.step):
            return False
        steps = [c.step for c in list_checkpoints(self.paths.checkpoints_dir)]
        raise UnknownModelError(f"{self.paths.name} has no checkpoint of step {step}; saved steps: {steps}")

    def prepare_step(self, step: int) -> None:
        """Before a request for saved `step`: load its adapter if this rank's engine may serve it
        (`policy`, which waits for a running training step), else only check that it exists (a
        dedicated training rank: the serving ranks load it, and training goes on meanwhile).

        Raises:
            UnknownModelError: if there is no checkpoint of `step`.
        """
        if self.serves:
            self.policy(step)
        else:
            self._is_saved(step)

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, n: int = 1, step: int | None = None,
               on_token: Any = None):
        """Queue a generation; returns a concurrent Future of n Completions (see Engine.submit).

        In a multi-GPU run the router picks the replica (this rank's engine or another rank's);
        all n samples run on it.
        """
        if self.router is not None:
            return self.router.submit(prompt_ids, params, n=n, step=step, on_token=on_token)
        return self._submit_local(prompt_ids, params, n=n, step=step, on_token=on_token)

    def abort(self, future: concurrent.futures.Future) -> None:
        """Stop the generation behind `future` (from `submit`): its client went away. A running
        request fails with RequestAborted, on this rank's engine or on another rank's replica
        (multi-GPU), and frees its batch slots and KV blocks there."""
        if not any(link.abort(future) for link in self.workers):
            self.engine.abort(future)

    def _submit_local(self, prompt_ids: list[int], params: SamplingParams, *, n: int, step: int | None,
                      on_token: Any) -> concurrent.futures.Future:
        return self.engine.submit(prompt_ids, params, n=n, policy=self.policy(step), on_token=on_token)

    def _submit_remote(self, link: WorkerLink, prompt_ids: list[int], params: SamplingParams, *, n: int,
                       step: int | None, on_token: Any) -> concurrent.futures.Future:
        """The request on another rank's replica; a grammar travels as its spec and is compiled there."""
        grammar = params.grammar
        if grammar is not None:
            params = dataclasses.replace(params, grammar=None)
        return link.submit({"name": self.paths.name, "prompt_ids": prompt_ids, "params": params, "n": n, "step": step,
                            "grammar": grammar.spec if grammar is not None else None}, on_token)

    # ---- training ---------------------------------------------------------------------------

    def train(self, groups: list[TrajectoryGroup], config: TrainConfig, on_event=None, log_step: bool = True) -> TrainResult:
        """One RL step on `groups`; saves checkpoint step + 1 and serves it.

        `on_event(dict)` receives progress: {"type": "started", ...}, one {"type": "update", ...}
        per optimizer update, {"type": "checkpoint", "step": ...}.

        `log_step`: append the step's row (group summaries and training metrics, at the step the groups
        were sampled from) to history.jsonl and write its trajectories, as ART's `model.train` did.
        ART >= 0.5.18's `backend.train` leaves that to the caller (`model.log(groups,
        metrics=result.metrics, step=result.step, split="train")`) and passes False.

        A trajectory with no assistant turn at all (tokenize.py) counts in its group's advantages
        and in `data/step_num_trajectories_without_tokens`, and adds no tokens.

        Raises:
            TrajectoryError: for an empty list of groups, a non-finite reward, a trajectory whose
                assistant turns were appended as messages instead of Choices, or a batch in which
                no trajectory has an assistant turn. Nothing is changed then.
            ConfigError: if `config` asks for a LoRA rank/alpha other than the adapter's.
        """
        start = time.perf_counter()
        emit = on_event or (lambda event: None)
        batch = rl_batch(groups, config, renderer=self.renderer, max_seq_len=self.max_seq_len,
                         vocab_size=self.vocab_size, policy_version=self.gate.version)
        sequences, num_trainable, num_groups = batch.sequences, batch.num_trainable, batch.num_groups
        # the call's host work beside the trainer's step (its own time is time/step_trainer_s)
        timings = {"time/step_prepare_s": time.perf_counter() - start, "time/step_checkpoint_s": 0.0}
        emit({"type": "started", "num_sequences": len(sequences), "num_groups": num_groups,
              "num_groups_trainable": num_trainable})
        with self.train_lock:
            data_step = self.step
            new_step = data_step + 1
            checkpoint = self.paths.checkpoint(new_step)
            ages = policy_age_metrics(groups, data_step)
            sharing = None
            with contextlib.ExitStack() as followers:
                if self.dedicated:  # the serving ranks compute part of the step when they are idle (help_train)
                    trainer = self._prepare_trainer(config)
                    sharing = self._shared_update(trainer, sequences, config, data_step)
                    if sharing is not None:
                        followers.enter_context(self._followed("help_train", sequences=sequences, config=config,
                                                               data_step=data_step, key=sharing.key))
                else:  # the other ranks take their part of the step (follow_train) while this one takes its own
                    followers.enter_context(self._followed("follow_train", sequences=sequences, config=config,
                                                           new_step=new_step))
                    trainer = self._prepare_trainer(config)

                def commit() -> None:
                    if config.save_checkpoint:
                        saving = time.perf_counter()
                        self._save(trainer, checkpoint, new_step)
                        timings["time/step_checkpoint_s"] = time.perf_counter() - saving
                        emit({"type": "checkpoint", "step": new_step})

                if sharing is not None:  # whatever fails before the step's sum, the serving ranks are released
                    followers.callback(trainer.release_shared, sharing)
                with self._training(trainer):
                    if sequences:
                        metrics = trainer.step(
                            sequences, config, commit=commit, on_update=lambda info: emit({"type": "update", **info}),
                            version=new_step, scorer=self._exact_scorer(), sharing=sharing,
                        ).values
                    else:
                        # the client reports it to the user (backends.base.report_nothing_learned); the
                        # server's own log keeps a line at INFO
                        log.info("training step %d (rollouts of step %d): none of the %d groups has reward spread; "
                                 "the adapter is unchanged", new_step, data_step, num_groups)
                        metrics = {}
                        commit()
                    sending = time.perf_counter()
                    self._send_adapter(trainer, new_step)
                    timings["time/step_send_adapter_s"] = time.perf_counter() - sending
                self._publish(new_step)
            if config.save_checkpoint:
                self._tidy_checkpoints(new_step, config)
        release_free_memory()
        if log_step:
            writing = time.perf_counter()
            write_trajectories(self.paths.trajectories("train", data_step), groups)
            timings["time/step_write_trajectories_s"] = time.perf_counter() - writing
        metrics.update(ages)
        metrics.update(timings)
        metrics.update({
            "data/step_num_groups_submitted": float(num_groups),
            "data/step_num_groups_trainable": float(num_trainable),
            "data/step_num_groups_skipped": float(num_groups - num_trainable),
            "data/step_num_trajectories": float(sum(len(g) for g in groups)),
            "data/step_num_trajectories_without_tokens": float(batch.num_without_tokens),
            "time/step_wall_s": time.perf_counter() - start,
        })
        row = {"step": data_step, **summarize_groups(groups, split="train"), **metrics}
        if log_step:
            append_history(self.paths.history, row)
        return TrainResult(
            step=new_step,
            metrics={k: float(v) for k, v in row.items() if isinstance(v, int | float) and k != "step"},
            checkpoint_path=str(checkpoint) if config.save_checkpoint else None,
            num_groups=num_groups,
            num_groups_trainable=num_trainable,
        )

    def train_sft(self, trajectories: list, config: TrainSFTConfig, on_event=None) -> TrainResult:
        """Supervised fine-tuning of the adapter on `trajectories`' assistant messages; saves checkpoint step + 1.

        Raises:
            TrajectoryError: for an empty list or a trajectory with no assistant message.
        """
        start = time.perf_counter()
        emit = on_event or (lambda event: None)
        if not trajectories:
            raise TrajectoryError("train_sft() got no trajectories")
        per_trajectory = []
        for i, trajectory in enumerate(trajectories):
            try:
                per_trajectory.append(in_vocabulary(sft_sequences(trajectory, self.renderer, max_seq_len=self.max_seq_len),
                                                  self.vocab_size))
            except TrajectoryError as exc:
                raise TrajectoryError(f"trajectory {i}: {exc}") from None
        with self.train_lock:
            data_step, new_step = self.step, self.step + 1
            checkpoint = self.paths.checkpoint(new_step)
            with self._followed("follow_train_sft", per_trajectory=per_trajectory, config=config, new_step=new_step,
                                skip=self.dedicated):
                trainer = self._prepare_trainer(TrainConfig())
                with _rng_restored_on_failure(trainer):  # the shuffle is part of the step a failure undoes
                    batches = sft_batches(per_trajectory, config, trainer.rng)  # the same on every rank: same RNG state
                    emit({"type": "started", "num_trajectories": len(trajectories), "num_updates": len(batches)})

                    def commit() -> None:
                        self._save(trainer, checkpoint, new_step)
                        emit({"type": "checkpoint", "step": new_step})

                    with self._training(trainer):
                        metrics = trainer.sft_step(batches, config, commit=commit,
                                                   on_update=lambda info: emit({"type": "update", **info}),
                                                   version=new_step).values
                        self._send_adapter(trainer, new_step)
                self._publish(new_step)
            self._tidy_checkpoints(new_step, config)
        release_free_memory()
        metrics["time/step_wall_s"] = time.perf_counter() - start
        append_history(self.paths.history, {"step": data_step, **metrics})
        return TrainResult(step=new_step, metrics={k: float(v) for k, v in metrics.items()}, checkpoint_path=str(checkpoint))

    # ---- the other ranks' part of a training call (multi-GPU) --------------------------------

    def follow_train(self, sequences: list[TokenizedSequence], config: TrainConfig, new_step: int) -> None:
        """On a rank other than 0: this rank's part of rank 0's `train` call (the same sequences,
        already tokenized, with advantages); rank 0 writes the checkpoint."""
        with self.train_lock:
            trainer = self._prepare_trainer(config)
            # under tensor parallelism this rank's shards are gathered into rank 0's checkpoint
            checkpoint = self.paths.checkpoint(new_step)
            commit = (lambda: self._save(trainer, checkpoint, new_step)) if self.tp and config.save_checkpoint else None
            if sequences:
                with self._training(trainer):
                    trainer.step(sequences, config, commit=commit, version=new_step, scorer=self._exact_scorer())
            elif self.tp is not None:  # the leader's call pauses the engine all the same
                with self._training(trainer):
                    if commit is not None:  # the checkpoint gathers the shards: collectives
                        commit()
            self._publish(new_step)
        release_free_memory()

    def follow_train_sft(self, per_trajectory: list, config: TrainSFTConfig, new_step: int) -> None:
        """On a rank other than 0: this rank's part of rank 0's `train_sft` call."""
        with self.train_lock:
            trainer = self._prepare_trainer(TrainConfig())
            with _rng_restored_on_failure(trainer):
                batches = sft_batches(per_trajectory, config, trainer.rng)
                checkpoint = self.paths.checkpoint(new_step)
                commit = (lambda: self._save(trainer, checkpoint, new_step)) if self.tp is not None else None
                with self._training(trainer):
                    trainer.sft_step(batches, config, commit=commit, version=new_step)
            self._publish(new_step)
        release_free_memory()

    # ---- dedicated mode: the adapter from the training rank to the serving ranks ----------------

    def _shared_update(self, trainer: Trainer, sequences: list[TokenizedSequence], config: TrainConfig,
                       data_step: int) -> SharedUpdate | None:
        """Dedicated rank 0: the step's update shared with the serving ranks (work_sharing.py), or
        None when it cannot be: `config.work_sharing` off, nothing to train, several optimizer
        updates, exact on-policy mode (its scorer is rank 0's engine), no store, a trainer or an
        engine of a transformers fallback (the serving rank's engine would wait for the whole
        call), or serving ranks that do not hold the adapter of `data_step` yet (they get it after
        rank 0's first step, `_send_adapter`)."""
        group = self._adapter_group
        if not (config.work_sharing and sequences and group is not None and group.store is not None
                and self._helpers_step == data_step and trainer.decoder is not None
                and isinstance(self.engine, Engine) and self._exact_scorer() is None
                and Trainer.count_updates(sequences, config) == 1):
            return None
        return SharedUpdate(group, group.store, f"{self.paths.name}/{data_step}/{secrets.token_hex(8)}")

    def help_train(self, sequences: list[TokenizedSequence], config: TrainConfig, data_step: int, key: str) -> int:
        """Dedicated serving rank: compute micro-batches of rank 0's step on the adapter of `data_step`
        while this rank's engine is idle, and add their gradient to rank 0's (work_sharing.py).
        Returns the micro-batches computed here.

        Raises:
            DistributedError: when rank 0's part of the step failed.
        """
        with self.train_lock:
            sharing = SharedUpdate(self._adapter_group, self._adapter_group.store, key)
            trainer = self.trainer  # rank 0 shares only once this rank holds its adapter (receive_adapter)
            # the adapter this rank holds must be the one rank 0 trains from; if not, this rank claims nothing
            same = self.step == data_step
            with self._training(trainer):
                return trainer.help_update(sequences, config, sharing, lambda: same and self.engine.is_idle)

    def _send_adapter(self, trainer: Trainer, new_step: int) -> None:
        """Dedicated rank 0, after a training call: broadcast the adapter's tensors to the serving
        ranks (`receive_adapter`). Called with the trainer's stream current, so the broadcast
        follows the step's last update. Nothing to do otherwise."""
        if not self.dedicated:
            return
        with self._followed("receive_adapter", lora=trainer.lora, new_step=new_step):
            self._adapter_group.broadcast_(trainer.params, src=0)
        self._helpers_step = new_step  # the serving ranks' adapter: they may share the next step

    def receive_adapter(self, lora: LoRAConfig, new_step: int) -> None:
        """Dedicated serving rank: take rank 0's adapter after its training call of `new_step`.

        The tensors arrive in buffers while the engine keeps decoding (on CUDA on a stream of
        their own), then replace the live adapter between two engine steps, with the policy
        version, under the gate. The first call injects the LoRA layers (`lora`, rank 0's).
        """
        with self.train_lock:
            if self.trainer is None:
                self.lora = lora
                with self.gate:  # the module tree an engine step reads changes
                    self.trainer = Trainer.new(self.model, lora, gate=self.gate)
            params = self.trainer.params
            with self._on_train_stream(), torch.no_grad():
                buffers = [torch.empty_like(p) for p in params]
                self._adapter_group.broadcast_(buffers, src=0)
                with self.gate:  # after the engine's last queued step, before its next one
                    torch._foreach_copy_(params, buffers)
                    self.step = new_step
                    self.gate.version = new_step

    @contextlib.contextmanager
    def _followed(self, method: str, *, skip: bool = False, **kwargs: Any):
        """Send `method(**kwargs)` to the other ranks' services (none without workers, or with
        `skip`), run the block, then wait for them. A dead worker's DistributedError wins (the
        block then fails with a collective's error that names no rank), then the block's error,
        then a worker's."""
        futures = [] if skip else [link.call(method, name=self.paths.name, **kwargs) for link in self.workers]
        try:
            yield
        except BaseException as exc:
            concurrent.futures.wait(futures)  # a dead worker fails its futures at once (parallel/channel.py)
            dead = next((link.error for link in self.workers if link.error is not None), None)
            if dead is not None and exc is not dead:
                raise dead from exc
            raise
        concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    def _prepare_trainer(self, config: TrainConfig) -> Trainer:
        """`_ensure_trainer` on every rank at once: every rank gets its trainer, or every rank raises."""
        error = None
        try:
            trainer = self._ensure_trainer(config)
        except Exception as exc:
            error = exc
        if self.dp is not None and not self.dp.agree(error is None, self.device):
            raise error or DistributedError("another rank could not set up its trainer; see its log")
        if error is not None:
            raise error
        return trainer

    @contextlib.contextmanager
    def _on_train_stream(self):
        """On CUDA, run the block on the trainer's own stream (made on first use), after what this
        thread queued on its current one; on CPU, as is."""
        if self.device.type != "cuda":
            yield
            return
        if self._train_stream is None:
            self._train_stream = torch.cuda.Stream(self.device)
        self._train_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._train_stream):
            yield

    @contextlib.contextmanager
    def _training(self, trainer: Trainer):
        """The context of a training call: on CUDA the trainer's own stream; the gate for the whole
        call when the engine and the trainer cannot overlap: a transformers fallback on either side
        (they share module state, such as train/eval mode and PEFT's active adapter), or tensor
        parallelism, where the engine's collectives and the trainer's must come in the same order on
        every rank of the group (see `Engine.pause_followers`): the leader pauses its engine and
        tells its followers, which start once they have run every engine step sent before."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._on_train_stream())
            if self.tp is not None and isinstance(self.engine, Engine):
                stack.enter_context(self.engine.paused_for_training())  # its lock is the gate
            elif not (isinstance(self.engine, Engine) and trainer.decoder is not None):
                stack.enter_context(self.gate)  # entered with the trainer's stream current
            yield

    def _exact_scorer(self):
        """With a batch-invariant engine, the trainer's source of exact logprob values: this engine's
        teacher-forced logprobs under the live weights (Engine.score); else None."""
        if not (isinstance(self.engine, Engine) and self.engine.config.batch_invariant):
            return None
        live = self.policy(None)
        return lambda token_ids, temperatures, routed_experts=None: self.engine.score(token_ids, temperatures, live,
                                                                                      routed_experts)

    def _publish(self, step: int) -> None:
        """Make `step` the latest: the trainer's last update already set the version; a step that
        changed nothing (no reward spread) moves it here."""
        with self.gate:
            self.step = step
            self.gate.version = step

    def _ensure_trainer(self, config: TrainConfig) -> Trainer:
        if self.trainer is None:
            lora = self.lora.model_copy(update={
                k: v for k, v in (("rank", config.lora_rank), ("alpha", config.lora_alpha)) if v is not None
            })
            with self.gate:  # injecting the LoRA layers changes the module tree an engine step reads
                self.trainer = Trainer.new(self.model, lora, gate=self.gate, dp=self.dp, tp=self.tp)
            return self.trainer
        for key, wanted in (("rank", config.lora_rank), ("alpha", config.lora_alpha)):
            have = getattr(self.trainer.lora, key)
            if wanted is not None and wanted != have:
                raise ConfigError(
                    f"TrainConfig(lora_{key}={wanted}) differs from the adapter of {self.paths.name!r}, "
                    f"which has {key} {have}; a LoRA's shape is fixed by its first step. Train a new model "
                    "name to change it"
                )
        return self.trainer

    def close(self) -> None:
        self.engine.close()


@contextlib.contextmanager
def _rng_restored_on_failure(trainer: Trainer) -> Iterator[None]:
    """The trainer's Python RNG as it was before the block if the block raises (a failed SFT call
    shuffled its batches before the trainer's own undo snapshot: the retry shuffles the same way)."""
    state = trainer.rng.getstate()
    try:
        yield
    except BaseException:
        trainer.rng.setstate(state)
        raise
