"""ART's options and what tempering does with each: the one table, and the functions that apply it.

ART configures its vLLM engine, its Unsloth/PEFT trainer and its training step through option
dicts (`TrainableModel(_internal_config=art.dev.InternalModelConfig(engine_args=..., init_args=...,
peft_args=..., trainer_args=...))`, `lora_config=...`, `backend.train(model, groups, **options)`,
`model.train(..., _config=...)`). Every option ART code passes goes through `ART_OPTIONS`:

- "mapped": tempering has the same setting; the value is applied.
- "differs": applied to the nearest tempering setting; the note says how the meaning differs.
- "ignored": no equivalent, and results do not depend on it (a vLLM/Unsloth performance or
  housekeeping knob); one `ArtOptionWarning` per call names every ignored option.
- "accepted": tempering always does what the option asks for; no warning.
- "refused": accepted silently at ART's default value (listed in `accepts`); any other value
  would change results, so it raises `UnsupportedOptionError` naming the option and the fix.

A key of a known section that the table does not list follows the section's `unknown` policy
(`SECTIONS`). The ART options section of docs/guides/art-compatibility.md is generated from this table
(`compatibility_markdown`), and a test checks that the two agree. `art_mapping` applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError, UnsupportedOptionError

__all__ = ["ART_OPTIONS", "BY_KEY", "SECTIONS", "ArtOption", "Section", "compatibility_markdown", "update_readme"]

Status = Literal["mapped", "differs", "ignored", "accepted", "refused"]
Updates = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ArtOption:
    """One ART option and tempering's answer to it.

    Attributes:
        section: where ART code passes it (a key of `SECTIONS`).
        name: the option's name in ART.
        status: see the module docstring.
        tempering: the tempering setting it maps to, for the docs' table ("" when none).
        note: how the meaning differs, or why it has no effect.
        to: (bucket, convert) for mapped/differs options: `convert(value)` returns the updates
            of the bucket ("engine": EngineConfig fields, "lora": LoRAConfig fields, "model":
            `max_seq_len`, "train": TrainConfig fields).
        accepts: for refused options, the values accepted without error.
    """

    section: str
    name: str
    status: Status
    tempering: str = ""
    note: str = ""
    to: tuple[str, Callable[[Any], Updates]] | None = None
    accepts: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    unknown: Literal["ignored", "error"]


SECTIONS: dict[str, Section] = {
    "train": Section("`backend.train(model, groups, **options)` and `model.train(..., _config=...)`", "error"),
    "internal_config": Section("`TrainableModel(_internal_config=art.dev.InternalModelConfig(...))`", "ignored"),
    "engine_args": Section("`_internal_config` → `engine_args=art.dev.EngineArgs(...)` (vLLM)", "ignored"),
    "init_args": Section("`_internal_config` → `init_args=art.dev.InitArgs(...)` (Unsloth)", "ignored"),
    "peft_args": Section("`_internal_config` → `peft_args=art.dev.PeftArgs(...)` (ART <= 0.5.17)", "ignored"),
    "lora_config": Section("`TrainableModel(lora_config=art.dev.LoRAConfig(...))` given as a dict (ART >= 0.5.18)", "ignored"),
    "trainer_args": Section("`_internal_config` → `trainer_args=art.dev.TrainerArgs(...)` (TRL/HF)", "ignored"),
    "local_backend": Section("`LocalBackend(...)`", "error"),
}


def _set(bucket: str, name: str, convert: Callable[[Any], Any] = lambda v: v) -> tuple[str, Callable[[Any], Updates]]:
    return bucket, lambda value: {name: convert(value)}


_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16",
           "float32": "float32", "float": "float32", "fp32": "float32"}


def _dtype(value: Any) -> Updates:
    """vLLM's `dtype` ("auto", "bfloat16", "half", "float32", ...) or Unsloth's (a torch.dtype or None)
    as the model's dtype name; "auto" and None: the device's default."""
    name = str(value).removeprefix("torch.").lower()
    if name in ("auto", "none"):
        return {}
    if name not in _DTYPES:
        raise UnsupportedOptionError(f"dtype={value!r} is not supported; use 'auto', 'bfloat16', 'float16' or 'float32'")
    return {"dtype": _DTYPES[name]}


def _load_format(value: Any) -> Updates:
    if value not in ("auto", "dummy"):
        raise UnsupportedOptionError(f"load_format={value!r} is not supported; use 'auto' (the checkpoint's weights, "
                                     "from safetensors) or 'dummy' (random weights)")
    return {"load_format": value}


def _importance_sampling_level(value: Any) -> Updates:
    if value == "sequence":
        return {"loss_fn": "gspo"}
    if value == "token":
        return {}
    raise UnsupportedOptionError(
        f"importance_sampling_level={value!r} is not supported; use 'token' (the default) or 'sequence' (GSPO)")


def _ppo(value: Any) -> Updates:
    return {"loss_fn": "ppo"} if value else {}


_VLLM_PERF = "a vLLM performance or logging knob; tempering's engine has its own scheduler"
_UNSLOTH = "an Unsloth loading knob; tempering loads the base weights itself"
_HOUSEKEEPING = "TRL/HF Trainer housekeeping; ART's trainer does not use it for the RL step either"
_RL_ONLY = "accepted only at ART's default; tempering does not implement it"

ART_OPTIONS: tuple[ArtOption, ...] = (
    # ---- backend.train options and model.train(_config=...) (ART's dev.TrainConfig) ----------------
    ArtOption("train", "learning_rate", "mapped", "TrainConfig.learning_rate",
              "ART's default is 5e-6 (backend.train), tempering's 5e-5", to=_set("train", "learning_rate")),
    ArtOption("train", "loss_fn", "mapped", "TrainConfig.loss_fn", "'ppo' or 'cispo' (tempering adds 'gspo'); "
              "backend.train defaults to CISPO in ART, tempering to PPO", to=_set("train", "loss_fn")),
    ArtOption("train", "ppo", "mapped", "TrainConfig.loss_fn='ppo'", to=("train", _ppo)),
    ArtOption("train", "epsilon", "mapped", "TrainConfig.epsilon", to=_set("train", "epsilon")),
    ArtOption("train", "epsilon_high", "mapped", "TrainConfig.epsilon_high", to=_set("train", "epsilon_high")),
    ArtOption("train", "kl_penalty_coef", "differs", "TrainConfig.kl_penalty_coef",
              "tempering adds coef × KL(π‖π_base) to the loss; ART shapes the advantages with it",
              to=_set("train", "kl_penalty_coef")),
    ArtOption("train", "beta", "mapped", "TrainConfig.kl_penalty_coef", "ART <= 0.4's name", to=_set("train", "beta")),
    ArtOption("train", "normalize_advantages", "mapped", "TrainConfig.normalize_advantages",
              to=_set("train", "normalize_advantages")),
    ArtOption("train", "scale_rewards", "mapped", "TrainConfig.normalize_advantages",
              "False: rewards are centred on the group mean but not divided by its std",
              to=_set("train", "normalize_advantages", bool)),
    ArtOption("train", "truncated_importance_sampling", "mapped", "TrainConfig.truncated_importance_sampling",
              to=_set("train", "truncated_importance_sampling")),
    ArtOption("train", "importance_sampling_level", "mapped", "TrainConfig.loss_fn='gspo'",
              "'token' (default) or 'sequence' (GSPO); 'average' and 'geometric_average' are refused",
              to=("train", _importance_sampling_level)),
    ArtOption("train", "mask_prob_ratio", "mapped", "TrainConfig.importance_ratio_mask",
              "True: tokens whose ratio leaves [1 - epsilon, 1 + epsilon_high] are dropped",
              to=_set("train", "_mask_prob_ratio", bool)),
    ArtOption("train", "logprob_calculation_chunk_size", "mapped", "TrainConfig.logprob_chunk_size",
              "memory only; values below 16 use 16", to=_set("train", "logprob_chunk_size", lambda v: max(int(v), 16))),
    ArtOption("train", "save_checkpoint", "mapped", "TrainConfig.save_checkpoint", to=_set("train", "save_checkpoint")),
    ArtOption("train", "verbose", "accepted", note="progress bars always show the step"),
    ArtOption("train", "grad_accumulation_sequences", "ignored", note="Megatron only in ART; tempering packs "
              "sequences into micro-batches of TrainConfig.micro_batch_tokens"),
    ArtOption("train", "allow_training_without_logprobs", "refused", note=_RL_ONLY + ": every trained turn "
              "needs the sampled Choice", accepts=(False,)),
    ArtOption("train", "plot_tensors", "refused", note=_RL_ONLY, accepts=(False,)),
    ArtOption("train", "scale_learning_rate_by_reward_std_dev", "refused", note=_RL_ONLY, accepts=(False,)),
    ArtOption("train", "packed_sequence_length", "refused", note="tempering packs rows of "
              "TrainConfig.micro_batch_tokens", accepts=(None,)),
    ArtOption("train", "advantage_balance", "refused", note=_RL_ONLY, accepts=(0, 0.0)),
    ArtOption("train", "kimi_k2_tau", "refused", note=_RL_ONLY, accepts=(None,)),
    ArtOption("train", "precalculate_logprobs", "refused", note="tempering always uses the sampled logprobs "
              "as π_old", accepts=(False,)),
    ArtOption("train", "max_negative_advantage_importance_sampling_weight", "refused", note=_RL_ONLY, accepts=(None,)),
    ArtOption("train", "num_trajectories_learning_rate_multiplier_power", "refused", note=_RL_ONLY, accepts=(0, 0.0)),
    ArtOption("train", "kl_penalty_reference_step", "refused", note="the KL reference is always the base model",
              accepts=(None,)),
    ArtOption("train", "kl_ref_adapter_path", "refused", note="the KL reference is always the base model",
              accepts=(None,)),
    ArtOption("train", "kl_penalty_source", "refused", note="the KL uses the current policy", accepts=("current_learner",)),
    ArtOption("train", "kl_penalty_step_lag", "refused", note=_RL_ONLY, accepts=(None,)),
    ArtOption("train", "loss_fn_config", "refused", note="must be None in ART too", accepts=(None,)),
    ArtOption("train", "adam_params", "refused", note="must be None in ART's LocalBackend too", accepts=(None,)),
    ArtOption("train", "megatron_topology", "refused", note="tempering trains on one device", accepts=(None,)),
    # ---- TrainableModel(_internal_config=...): top-level keys -----------------------------------------
    ArtOption("internal_config", "engine_args", "mapped", "EngineConfig", "see the engine_args table"),
    ArtOption("internal_config", "init_args", "mapped", "", "see the init_args table"),
    ArtOption("internal_config", "peft_args", "mapped", "LoRAConfig", "see the peft_args table"),
    ArtOption("internal_config", "trainer_args", "mapped", "TrainConfig defaults", "see the trainer_args table"),
    ArtOption("internal_config", "tinker_args", "ignored", note="used only by ART's Tinker backends"),
    ArtOption("internal_config", "tinker_native_args", "ignored", note="used only by ART's Tinker backends"),
    ArtOption("internal_config", "trainer_gpu_ids", "differs", "dedicated mode of `LocalBackend(gpus=N)`",
              "with inference_gpu_ids (ART: setting both selects dedicated mode), rank 0 trains and ranks 1..N-1 "
              "serve; tempering trains on one GPU there, so it must be [0]",
              to=("placement", lambda v: {"trainer_gpu_ids": v})),
    ArtOption("internal_config", "inference_gpu_ids", "differs", "dedicated mode of `LocalBackend(gpus=N)`",
              "the serving GPUs: all the others, [1, ..., N-1] (ART allows exactly one)",
              to=("placement", lambda v: {"inference_gpu_ids": v})),
    ArtOption("internal_config", "rollout_weights_mode", "ignored", note="tempering serves the trainer's own LoRA "
              "tensors, unmerged"),
    ArtOption("internal_config", "rollout_weight_update_mode", "ignored", note="a new policy is served as soon "
              "as a step ends"),
    ArtOption("internal_config", "chat_template_content_format", "ignored", note="vLLM's request parsing"),
    ArtOption("internal_config", "chat_template_tool_schema_format", "ignored", note="tools are rendered "
              "as the model's template (or tempering's Hermes prompt) says"),
    ArtOption("internal_config", "allow_unvalidated_arch", "ignored", note="any architecture runs (unknown ones "
              "through transformers)"),
    ArtOption("internal_config", "megatron_topology", "ignored", note="Megatron only"),
    ArtOption("internal_config", "megatron_model_initialization", "refused", note="training starts from "
              "the pretrained weights", accepts=("pretrained",)),
    ArtOption("internal_config", "chat_template", "refused", note="put the template in the base model "
              "directory's tokenizer_config.json instead", accepts=(None,)),
    ArtOption("internal_config", "chat_template_path", "refused", note="put the template in the base model "
              "directory's tokenizer_config.json instead", accepts=(None,)),
    ArtOption("internal_config", "chat_template_kwargs", "refused", note="the model's template is rendered "
              "with its defaults", accepts=(None, {})),
    ArtOption("internal_config", "vllm_runtime", "refused", note="tempering serves with its own engine; "
              "an external vLLM server cannot be attached", accepts=(None,)),
    # ---- engine_args (vLLM EngineArgs) ------------------------------------------------------------------
    ArtOption("engine_args", "max_num_seqs", "mapped", "EngineConfig.max_num_seqs", to=_set("engine", "max_num_seqs")),
    ArtOption("engine_args", "load_format", "mapped", "EngineConfig.load_format",
              "'auto' or 'dummy' (random weights from the config, for benchmarks); other formats are refused",
              to=("engine", _load_format)),
    ArtOption("engine_args", "max_num_batched_tokens", "mapped", "EngineConfig.max_num_batched_tokens",
              to=_set("engine", "max_num_batched_tokens")),
    ArtOption("engine_args", "enable_prefix_caching", "mapped", "EngineConfig.enable_prefix_caching",
              to=_set("engine", "enable_prefix_caching", bool)),
    ArtOption("engine_args", "block_size", "mapped", "EngineConfig.block_size", to=_set("engine", "block_size")),
    ArtOption("engine_args", "num_gpu_blocks_override", "mapped", "EngineConfig.num_kv_blocks",
              to=_set("engine", "num_kv_blocks")),
    ArtOption("engine_args", "kv_offloading_size", "mapped", "EngineConfig.kv_offloading_size",
              "GiB of host memory for KV blocks evicted from the GPU (vLLM's native KV offloading); agents' "
              "conversations come back by copy instead of prefill", to=_set("engine", "kv_offloading_size", float)),
    ArtOption("engine_args", "disable_cascade_attn", "mapped", "EngineConfig.cascade_attention = not disable_cascade_attn",
              "vLLM allows it by default; tempering's engine runs it only when asked (False here turns it on): "
              "decode rows sharing a long prefix read its keys once per tile of rows",
              to=_set("engine", "cascade_attention", lambda v: not v)),
    ArtOption("engine_args", "enforce_eager", "mapped", "EngineConfig.use_cuda_graphs = not enforce_eager",
              to=_set("engine", "use_cuda_graphs", lambda v: not v)),
    ArtOption("engine_args", "max_model_len", "mapped", "the model's max sequence length",
              "capped at the model's context length", to=_set("model", "max_seq_len")),
    ArtOption("engine_args", "gpu_memory_utilization", "differs", "EngineConfig.gpu_memory_fraction",
              "vLLM's share of all GPU memory (weights + KV cache; vLLM sleeps while ART trains) becomes the KV "
              "cache's share of the memory left after the weights, while the trainer uses the rest",
              to=_set("engine", "gpu_memory_fraction")),
    *(ArtOption("engine_args", name, "ignored", note=_VLLM_PERF) for name in (
        "num_scheduler_steps", "enable_chunked_prefill", "preemption_mode", "swap_space", "cpu_offload_gb",
        "disable_log_stats", "disable_log_requests", "enable_log_requests", "max_seq_len_to_capture",
        "max_parallel_loading_workers", "scheduler_delay_factor", "disable_async_output_proc")),
    ArtOption("engine_args", "enable_sleep_mode", "ignored", note="tempering's engine and trainer share the "
              "weights, so nothing needs to sleep during a step"),
    *(ArtOption("engine_args", name, "ignored", note="tempering applies any LoRA rank, unmerged")
      for name in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")),
    ArtOption("engine_args", "tensor_parallel_size", "mapped", "EngineConfig.tensor_parallel_size",
              "the model is split over that many GPUs of the backend's run (LocalBackend(gpus=N), N a multiple of "
              "it); the Llama family", to=_set("engine", "tensor_parallel_size", int)),
    ArtOption("engine_args", "pipeline_parallel_size", "ignored", note="tempering does not split layers over GPUs"),
    ArtOption("engine_args", "dtype", "mapped", "the model's dtype (engine and trainer)",
              "'auto' (the default): float32 on a CPU; on a GPU float32 up to 0.5B parameters (engine and trainer "
              "agree to ~1e-5 nats), bfloat16 above", to=("model", _dtype)),
    ArtOption("engine_args", "seed", "ignored", note="pass `seed` per request (tempering's sampling is "
              "seeded per request, whatever shares the batch)"),
    ArtOption("engine_args", "rope_scaling", "refused", note="the model's own rotary settings are used",
              accepts=(None,)),
    ArtOption("engine_args", "quantization", "refused", note="tempering serves the unquantized weights",
              accepts=(None,)),
    # ---- init_args (Unsloth FastLanguageModel.from_pretrained) -----------------------------------------
    ArtOption("init_args", "max_seq_length", "mapped", "the model's max sequence length (engine and trainer)",
              "capped at the model's context length", to=_set("model", "max_seq_len")),
    ArtOption("init_args", "gpu_memory_utilization", "differs", "EngineConfig.gpu_memory_fraction",
              "as engine_args.gpu_memory_utilization", to=_set("engine", "gpu_memory_fraction")),
    ArtOption("init_args", "enable_prefix_caching", "mapped", "EngineConfig.enable_prefix_caching",
              to=_set("engine", "enable_prefix_caching", bool)),
    ArtOption("init_args", "use_gradient_checkpointing", "mapped", "TrainConfig.gradient_checkpointing",
              "'unsloth' and True turn it on", to=_set("train", "gradient_checkpointing", bool)),
    ArtOption("init_args", "load_in_4bit", "ignored", note="tempering trains LoRA on the unquantized base "
              "weights (ART's Unsloth path uses 4-bit QLoRA)"),
    ArtOption("init_args", "load_in_8bit", "ignored", note="tempering trains LoRA on the unquantized base weights"),
    ArtOption("init_args", "load_in_16bit", "ignored", note="tempering trains LoRA on the unquantized base weights"),
    ArtOption("init_args", "dtype", "mapped", "the model's dtype (engine and trainer)", "as engine_args.dtype",
              to=("model", _dtype)),
    *(ArtOption("init_args", name, "ignored", note=_UNSLOTH) for name in (
        "fast_inference", "max_lora_rank", "random_state", "disable_log_stats", "float8_kv_cache", "use_async",
        "token", "device_map", "fix_tokenizer", "trust_remote_code", "use_exact_model_name", "revision")),
    ArtOption("init_args", "model_name", "refused", note="the base model is TrainableModel.base_model",
              accepts=(None,)),
    ArtOption("init_args", "full_finetuning", "refused", note="tempering trains a LoRA adapter", accepts=(False,)),
    ArtOption("init_args", "rope_scaling", "refused", note="the model's own rotary settings are used",
              accepts=(None,)),
    ArtOption("init_args", "resize_model_vocab", "refused", note="the vocabulary is the base model's", accepts=(None,)),
    # ---- peft_args (PEFT LoraConfig names, ART <= 0.5.17) ----------------------------------------------
    ArtOption("peft_args", "r", "mapped", "LoRAConfig.rank", to=_set("lora", "rank")),
    ArtOption("peft_args", "lora_alpha", "mapped", "LoRAConfig.alpha", to=_set("lora", "alpha")),
    ArtOption("peft_args", "lora_dropout", "mapped", "LoRAConfig.dropout", to=_set("lora", "dropout")),
    ArtOption("peft_args", "target_modules", "mapped", "LoRAConfig.target_modules",
              to=_set("lora", "target_modules", list)),
    *(ArtOption("peft_args", name, "ignored", note=_UNSLOTH) for name in (
        "use_gradient_checkpointing", "random_state", "max_seq_length", "temporary_location")),
    ArtOption("peft_args", "bias", "refused", note="LoRA adapters without bias terms", accepts=("none", None)),
    ArtOption("peft_args", "use_rslora", "refused", note="the update is scaled by alpha / rank", accepts=(False,)),
    ArtOption("peft_args", "init_lora_weights", "refused", note="B = 0, so training starts at the base policy",
              accepts=(True,)),
    ArtOption("peft_args", "modules_to_save", "refused", note="only the LoRA matrices are trained", accepts=(None,)),
    ArtOption("peft_args", "layers_to_transform", "refused", note="LoRA goes on every layer", accepts=(None,)),
    ArtOption("peft_args", "layers_pattern", "refused", note="LoRA goes on every layer", accepts=(None,)),
    ArtOption("peft_args", "loftq_config", "refused", note="no LoftQ initialisation", accepts=(None, {})),
    # ---- lora_config given as ART's dev.LoRAConfig dict (ART >= 0.5.18) --------------------------------
    ArtOption("lora_config", "rank", "mapped", "LoRAConfig.rank", to=_set("lora", "rank")),
    ArtOption("lora_config", "alpha", "mapped", "LoRAConfig.alpha", to=_set("lora", "alpha")),
    ArtOption("lora_config", "dropout", "mapped", "LoRAConfig.dropout", to=_set("lora", "dropout")),
    ArtOption("lora_config", "target_modules", "mapped", "LoRAConfig.target_modules",
              to=_set("lora", "target_modules", list)),
    *(ArtOption("lora_config", name, "ignored", note=_UNSLOTH) for name in (
        "use_gradient_checkpointing", "random_state", "max_seq_length", "temporary_location")),
    ArtOption("lora_config", "bias", "refused", note="LoRA adapters without bias terms", accepts=("none", None)),
    ArtOption("lora_config", "use_rslora", "refused", note="the update is scaled by alpha / rank", accepts=(False,)),
    ArtOption("lora_config", "init_weights", "refused", note="B = 0, so training starts at the base policy",
              accepts=(True,)),
    ArtOption("lora_config", "modules_to_save", "refused", note="only the LoRA matrices are trained", accepts=(None,)),
    ArtOption("lora_config", "layers_to_transform", "refused", note="LoRA goes on every layer", accepts=(None,)),
    ArtOption("lora_config", "layers_pattern", "refused", note="LoRA goes on every layer", accepts=(None,)),
    ArtOption("lora_config", "loftq_config", "refused", note="no LoftQ initialisation", accepts=(None, {})),
    # ---- trainer_args (HF/TRL GRPOConfig) ---------------------------------------------------------------
    ArtOption("trainer_args", "max_grad_norm", "mapped", "TrainConfig.max_grad_norm (default of every step)",
              "ART's default is 0.1, tempering's 1.0", to=_set("train", "max_grad_norm")),
    ArtOption("trainer_args", "weight_decay", "mapped", "TrainConfig.weight_decay (default of every step)",
              "ART's default is 0.1, tempering's 0", to=_set("train", "weight_decay")),
    ArtOption("trainer_args", "gradient_checkpointing", "mapped", "TrainConfig.gradient_checkpointing",
              to=_set("train", "gradient_checkpointing", bool)),
    ArtOption("trainer_args", "save_total_limit", "differs", "TrainConfig.keep_last_checkpoints (default of every step)",
              "the newest N checkpoints are kept, and the best by metric_for_best_model besides them",
              to=_set("train", "keep_last_checkpoints")),
    ArtOption("trainer_args", "metric_for_best_model", "differs",
              "TrainConfig.best_checkpoint_metric (default of every step)",
              "a history metric such as \"val/reward\"; the highest value is the best",
              to=_set("train", "best_checkpoint_metric")),
    ArtOption("trainer_args", "learning_rate", "ignored", note="each step's learning_rate wins, as in ART"),
    ArtOption("trainer_args", "optim", "ignored", note="tempering uses AdamW (betas 0.9/0.999, float32 states); "
              "ART's default is paged 8-bit AdamW"),
    *(ArtOption("trainer_args", name, "ignored", note=_HOUSEKEEPING) for name in (
        "output_dir", "logging_steps", "report_to", "save_strategy", "save_steps", "num_train_epochs", "max_steps",
        "per_device_train_batch_size", "gradient_accumulation_steps", "loss_type", "num_generations", "temperature",
        "max_completion_length", "max_prompt_length", "seed", "bf16", "fp16", "disable_tqdm", "run_name")),
    ArtOption("trainer_args", "lr_scheduler_type", "refused", note="the learning rate is constant within a step; "
              "pass a different learning_rate per step for a schedule", accepts=("constant",)),
    ArtOption("trainer_args", "warmup_steps", "refused", note="no warmup; pass a learning_rate per step",
              accepts=(0,)),
    ArtOption("trainer_args", "warmup_ratio", "refused", note="no warmup; pass a learning_rate per step",
              accepts=(0, 0.0)),
    ArtOption("trainer_args", "adam_beta1", "refused", note="tempering's AdamW uses 0.9", accepts=(0.9,)),
    ArtOption("trainer_args", "adam_beta2", "refused", note="tempering's AdamW uses 0.999", accepts=(0.999,)),
    ArtOption("trainer_args", "adam_epsilon", "refused", note="tempering's AdamW uses 1e-8", accepts=(1e-8,)),
    # ---- LocalBackend(...) ----------------------------------------------------------------------------
    ArtOption("local_backend", "path", "differs", "LocalBackend(path=...)", "default ./.tempering (ART: ./.art)"),
    ArtOption("local_backend", "in_process", "differs", "LocalBackend(in_process=...)",
              "default True (ART: False); False runs the server in a child process, driven over HTTP"),
    ArtOption("local_backend", "gpu_cost_per_hour_usd", "ignored", note="no costs/gpu metric is logged"),
    ArtOption("local_backend", "enable_expert_replay", "ignored", note="MoE routing replay does not apply: the "
              "engine and the trainer run the same forward"),
)

BY_KEY: dict[tuple[str, str], ArtOption] = {(o.section, o.name): o for o in ART_OPTIONS}


_STATUS_TEXT = {"mapped": "mapped", "differs": "mapped, differs", "ignored": "ignored (warning)",
                "accepted": "accepted (no effect needed)", "refused": "refused unless"}


def compatibility_markdown() -> str:
    """The table of ART options in docs/guides/art-compatibility.md (generated: edit ART_OPTIONS, not the page)."""
    lines: list[str] = []
    for key, section in SECTIONS.items():
        rows = [o for o in ART_OPTIONS if o.section == key]
        unknown = ("other keys: ignored with a warning" if section.unknown == "ignored"
                   else "other keys: an error")
        lines += ["", f"**{section.title}** ({unknown})", "", "| ART option | tempering | notes |", "|---|---|---|"]
        for o in rows:
            status = _STATUS_TEXT[o.status]
            if o.status == "refused":
                status += " " + " or ".join(f"`{a!r}`" for a in o.accepts)
            target = f"{status}: {o.tempering}" if o.tempering else status
            lines.append(f"| `{o.name}` | {target} | {o.note} |")
    return "\n".join(lines).strip() + "\n"


_BEGIN, _END = "<!-- art-options:begin -->\n", "<!-- art-options:end -->"


def update_readme(path: str) -> bool:
    """Rewrite the generated table between the markers in `path`; True if the file changed.

    Raises:
        ConfigError: if the file lacks the `<!-- art-options:begin -->` / `end` markers.
    """
    from pathlib import Path

    readme = Path(path)
    text = readme.read_text()
    if _BEGIN not in text or _END not in text:
        raise ConfigError(f"{path} lacks the {_BEGIN.strip()} ... {_END} markers")
    head, rest = text.split(_BEGIN, 1)
    _, tail = rest.split(_END, 1)
    new = head + _BEGIN + compatibility_markdown() + _END + tail
    if new != text:
        readme.write_text(new)
    return new != text

