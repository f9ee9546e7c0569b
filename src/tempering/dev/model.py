"""ART's per-model option dicts: `InternalModelConfig` and its `InitArgs`, `PeftArgs`, `TrainerArgs`, ..."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from .engine import EngineArgs

__all__ = [
    "InitArgs",
    "InternalModelConfig",
    "LoRAConfig",
    "PeftArgs",
    "TinkerArgs",
    "TinkerNativeArgs",
    "TinkerTrainingClientArgs",
    "TrainerArgs",
]


class InitArgs(TypedDict, total=False):
    """Unsloth `FastLanguageModel.from_pretrained` options; `max_seq_length` caps the sequences
    tempering serves and trains, `gpu_memory_utilization` sizes the KV cache."""

    model_name: str
    max_seq_length: int
    dtype: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    load_in_16bit: bool
    full_finetuning: bool
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    use_gradient_checkpointing: str | bool
    fast_inference: bool
    max_lora_rank: int
    random_state: int
    rope_scaling: dict[str, Any] | None


class PeftArgs(TypedDict, total=False):
    """PEFT LoRA options in ART <= 0.5.17's names (`r`, `lora_alpha`, ...), mapped to tempering's LoRAConfig."""

    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list[str]
    bias: str
    use_rslora: bool
    init_lora_weights: bool
    modules_to_save: list[str] | None
    layers_to_transform: list[int] | None
    use_gradient_checkpointing: str | bool
    random_state: int


class LoRAConfig(TypedDict, total=False):
    """ART >= 0.5.18's LoRA options for `TrainableModel(lora_config=...)` (`rank`, `alpha`, ...)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    bias: str
    use_rslora: bool
    init_weights: bool
    modules_to_save: list[str] | None
    layers_to_transform: list[int] | None


class TrainerArgs(TypedDict, total=False):
    """HF/TRL trainer options; `max_grad_norm`, `weight_decay`, `gradient_checkpointing`,
    `save_total_limit` and `metric_for_best_model` become the defaults of every step's TrainConfig
    (the last two as `keep_last_checkpoints` and `best_checkpoint_metric`)."""

    max_grad_norm: float
    weight_decay: float
    gradient_checkpointing: bool
    learning_rate: float
    optim: str
    lr_scheduler_type: str
    warmup_steps: int
    warmup_ratio: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    logging_steps: float
    save_total_limit: int | None
    metric_for_best_model: str | None
    output_dir: str | None
    report_to: str | list[str] | None


class TinkerTrainingClientArgs(TypedDict, total=False):
    """Options of ART's Tinker training client (ignored by tempering)."""

    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


class TinkerArgs(TypedDict, total=False):
    """Options of ART's Tinker backend (ignored by tempering)."""

    renderer_name: str
    training_client_args: TinkerTrainingClientArgs


class TinkerNativeArgs(TypedDict, total=False):
    """Options of ART's native Tinker backend (ignored by tempering)."""

    renderer_name: str
    training_client_args: TinkerTrainingClientArgs


class InternalModelConfig(TypedDict, total=False):
    """`TrainableModel(_internal_config=...)`: per-model engine, loading, LoRA and trainer options."""

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    trainer_args: TrainerArgs
    tinker_args: TinkerArgs | None
    tinker_native_args: TinkerNativeArgs | None
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]
    rollout_weights_mode: Literal["lora", "merged"]
    chat_template: str
    chat_template_path: str
    chat_template_kwargs: dict[str, Any]
    allow_unvalidated_arch: bool
