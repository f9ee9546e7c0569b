"""The policy-gradient step on a LoRA adapter (PEFT) of a transformers causal LM.

One `step()` is one RL step: the trajectories are split into mini-batches of `batch_size`
trajectories (one mini-batch when None), each gets one optimizer update, and each update
accumulates gradients over micro-batches that fit `micro_batch_tokens`. The loss is the sum of
per-token losses divided by the number of trained tokens of the mini-batch (token-mean, as in
DAPO/TRL's default), so micro-batching does not change it.

If a step fails half way, the adapter and optimizer are restored to what they were before it,
so the live policy always equals the last checkpoint or a complete step.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from ..types import LoRAConfig, TrainConfig
from .batching import MicroBatch, make_micro_batches
from .logprobs import selective_logprobs
from .losses import policy_loss
from .tokenize import TokenizedSequence

__all__ = ["StepMetrics", "Trainer"]


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """Silence one FutureWarning: peft 0.21 reads `model.is_gradient_checkpointing`, which
    transformers 5 deprecated in favour of `is_activation_checkpointing`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield

ADAPTER_NAME = "default"


@dataclass(slots=True)
class StepMetrics:
    values: dict[str, float]


class Trainer:
    """Owns the PEFT model and its AdamW optimizer.

    Build it with `Trainer.new(model, lora)` (a fresh adapter, B = 0 so the policy starts as the
    base model) or `Trainer.from_adapter(model, adapter_dir)` (continue from a PEFT adapter).
    The LoRA layers are injected into `model` in place, so an engine holding `model` samples
    from the live adapter with no copy.
    """

    def __init__(self, peft_model: Any, lora: LoRAConfig, *, gradient_checkpointing: bool = False) -> None:
        self.peft_model = peft_model
        self.lora = lora
        self.model = peft_model.get_base_model()  # the transformers model with LoRA layers inside
        self.params = [p for p in peft_model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the adapter has no trainable parameters; check LoRA target_modules")
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
        self.gradient_checkpointing = gradient_checkpointing
        self.num_updates = 0
        self._rng = random.Random(0)

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def new(cls, model: Any, lora: LoRAConfig, *, seed: int = 0, **kwargs: Any) -> Trainer:
        from peft import LoraConfig, get_peft_model

        targets = [m for m in lora.target_modules if any(n.endswith(m) for n, _ in model.named_modules())]
        if not targets:
            raise ConfigError(f"none of the LoRA target_modules {lora.target_modules} exist in this model")
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]), _quiet_peft():
            torch.manual_seed(seed)  # reproducible A init (B starts at 0)
            peft_model = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
        return cls(peft_model, lora, **kwargs)

    @classmethod
    def from_adapter(cls, model: Any, adapter_dir: Path, **kwargs: Any) -> Trainer:
        from peft import PeftModel

        try:
            with _quiet_peft():
                peft_model = PeftModel.from_pretrained(
                    model, str(adapter_dir), adapter_name=ADAPTER_NAME, is_trainable=True
                )
        except Exception as exc:
            raise CheckpointError(f"could not load the LoRA adapter in {adapter_dir}: {exc}") from exc
        config = peft_model.peft_config[ADAPTER_NAME]
        targets = sorted(config.target_modules) if not isinstance(config.target_modules, str) else [config.target_modules]
        lora = LoRAConfig(rank=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout, target_modules=targets)
        return cls(peft_model, lora, **kwargs)

    # ---- saving ---------------------------------------------------------------------------

    def save(self, directory: Path, *, step: int) -> None:
        """Write the adapter (PEFT format), optimizer state and trainer state into `directory`."""
        self.peft_model.save_pretrained(str(directory), selected_adapters=[ADAPTER_NAME])
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        state = {"step": step, "num_updates": self.num_updates, "lora": self.lora.model_dump()}
        (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))

    def load_optimizer(self, directory: Path) -> None:
        """Restore optimizer state saved by `save` (if the checkpoint has one)."""
        path = directory / "optimizer.pt"
        if path.is_file():
            self.optimizer.load_state_dict(torch.load(path, map_location=self.params[0].device, weights_only=True))
        state_path = directory / "trainer_state.json"
        if state_path.is_file():
            self.num_updates = int(json.loads(state_path.read_text()).get("num_updates", 0))

    # ---- the step -------------------------------------------------------------------------

    def step(
        self, sequences: list[TokenizedSequence], config: TrainConfig, *, commit: Callable[[], None] | None = None
    ) -> StepMetrics:
        """One RL step on sequences whose `advantage` is set.

        `commit` (say, writing the checkpoint) runs after the update; if the update or `commit`
        raises, the adapter and optimizer are put back as they were and the error propagates.

        Raises:
            ConfigError: if `sequences` is empty.
        """
        if not sequences:
            raise ConfigError("nothing to train on: every sequence was filtered out")
        snapshot = self._snapshot()
        try:
            metrics = self._step(sequences, config)
            if commit is not None:
                commit()
            return metrics
        except BaseException:
            self._restore(snapshot)
            raise

    def _step(self, sequences: list[TokenizedSequence], config: TrainConfig) -> StepMetrics:
        start = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = config.learning_rate
            group["weight_decay"] = config.weight_decay
        self.model.train()
        if self.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.peft_model.enable_input_require_grads()
        device = self.params[0].device

        # mini-batches of whole trajectories
        by_trajectory: dict[tuple[int, int], list[TokenizedSequence]] = {}
        for s in sequences:
            by_trajectory.setdefault((s.group_index, s.trajectory_index), []).append(s)
        trajectories = list(by_trajectory.values())
        size = config.batch_size or len(trajectories)
        if size < len(trajectories):
            self._rng.shuffle(trajectories)
        minibatches = [sum(trajectories[i:i + size], []) for i in range(0, len(trajectories), size)]

        totals = dict(loss=0.0, tokens=0, completion_tokens=0, entropy=0.0, clipped=0, ratio_sum=0.0)
        ratio_max, grad_norms = 0.0, []
        for minibatch in minibatches:
            num_trained = sum(s.num_completion_tokens for s in minibatch)
            if num_trained == 0:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            for micro in make_micro_batches(minibatch, max_tokens=config.micro_batch_tokens):
                out = self._micro_step(micro.to(device), config, num_trained)
                for k in ("loss", "entropy", "clipped", "ratio_sum"):
                    totals[k] += out[k]
                totals["tokens"] += micro.num_tokens
                totals["completion_tokens"] += out["n"]
                ratio_max = max(ratio_max, out["ratio_max"])
            max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            if not torch.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite gradient norm {grad_norm.item()}; the step was undone")
            grad_norms.append(float(grad_norm))
            self.optimizer.step()
            self.num_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.gradient_checkpointing:
            self.model.gradient_checkpointing_disable()
        elapsed = time.perf_counter() - start
        n = max(totals["completion_tokens"], 1)
        return StepMetrics({
            "loss/train": totals["loss"] / max(len(grad_norms), 1),
            "loss/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "loss/entropy": totals["entropy"] / n,
            "loss/learning_rate": config.learning_rate,
            "loss/clip_fraction": totals["clipped"] / n,
            "offpolicy/ratio_mean": totals["ratio_sum"] / n,
            "offpolicy/ratio_max": ratio_max,
            "data/step_trainer_tokens": float(totals["tokens"]),
            "data/step_completion_tokens": float(totals["completion_tokens"]),
            "data/step_num_optimizer_updates": float(len(grad_norms)),
            "time/step_trainer_s": elapsed,
            "throughput/trainer_tok_per_s": totals["tokens"] / elapsed if elapsed > 0 else 0.0,
        })

    def _micro_step(self, micro: MicroBatch, config: TrainConfig, num_trained: int) -> dict[str, float]:
        hidden = self.model.get_decoder()(
            input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False
        ).last_hidden_state  # [B, T, H]
        # position t predicts token t + 1
        target_mask = micro.loss_mask[:, 1:]  # [B, T-1]
        h = hidden[:, :-1][target_mask]  # [N, H]
        targets = micro.input_ids[:, 1:][target_mask]  # [N]
        sampled = micro.sampled_logprobs[:, 1:][target_mask]
        advantages = micro.advantages[:, 1:][target_mask]
        temperature = micro.temperature[:, 1:][target_mask]
        weight = self.model.get_output_embeddings().weight
        new_logprobs, entropy = selective_logprobs(h, weight, targets, temperature)
        loss_tok, clipped = policy_loss(
            new_logprobs, sampled, advantages, loss_fn=config.loss_fn, clip_low=config.clip_low, clip_high=config.clip_high
        )
        loss = loss_tok.sum() / num_trained
        loss.backward()
        ratio = torch.exp(new_logprobs.detach() - sampled)
        return {
            "loss": float(loss.detach()),
            "n": int(targets.numel()),
            "entropy": float(entropy.sum()),
            "clipped": float(clipped.sum()),
            "ratio_sum": float(ratio.sum()),
            "ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
        }

    # ---- failure safety -------------------------------------------------------------------

    def _snapshot(self) -> tuple[list[torch.Tensor], dict, int]:
        import copy

        return [p.detach().clone() for p in self.params], copy.deepcopy(self.optimizer.state_dict()), self.num_updates

    def _restore(self, snapshot: tuple[list[torch.Tensor], dict, int]) -> None:
        params, optimizer_state, self.num_updates = snapshot
        with torch.no_grad():
            for p, saved in zip(self.params, params):
                p.copy_(saved)
                p.grad = None
        self.optimizer.load_state_dict(optimizer_state)
