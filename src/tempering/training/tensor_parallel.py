"""The trainer's checkpoints under tensor parallelism: always the full adapter, whatever the group size.

Each rank trains its shards of the LoRA tensors (modeling/tensor_parallel.py: a column-parallel layer's B
and a row-parallel layer's A are split, the rest replicated). A checkpoint holds the whole
adapter as one PEFT directory, the one a single GPU writes (adapter_config.json +
adapter_model.safetensors), and the optimizer state as a single GPU's `optimizer.pt`: the ranks
gather the shards and TP rank 0 writes. Loading reads the full files on every rank and keeps the
rank's slices, so a checkpoint resumes at any tensor-parallel size, 1 included.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..modeling.tensor_parallel import TensorParallel, lora_shard_dim

__all__ = ["full_optimizer_state", "load_sharded_adapter", "save_full_adapter", "shard_optimizer_state"]


def _saved_key(name: str, adapter: str) -> str:
    """A PEFT parameter's name as saved: `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`."""
    return name.replace(f".{adapter}.", ".")


def save_full_adapter(peft_model: Any, adapter: str, tp: TensorParallel, directory: Path | None) -> None:
    """Gather the adapter's shards (collective: every rank of `tp` calls it) and write them to
    `directory` in PEFT's format; the ranks that pass None write nothing (with several replicas,
    only the first replica's TP rank 0 writes)."""
    from safetensors.torch import save_file

    full = {}
    for name, p in peft_model.named_parameters():
        if ".lora_" in name and f".{adapter}." in name:
            full[_saved_key(name, adapter)] = tp.gather(p.detach(), lora_shard_dim(name)).cpu().contiguous()
    if directory is None:
        return
    config = peft_model.peft_config[adapter]
    is_inference, config.inference_mode = config.inference_mode, True  # as PEFT's save_pretrained writes it
    try:
        config.save_pretrained(str(directory))
    finally:
        config.inference_mode = is_inference
    save_file(full, str(Path(directory) / "adapter_model.safetensors"), metadata={"format": "pt"})


def load_sharded_adapter(model: Any, adapter_dir: Path, adapter: str, tp: TensorParallel) -> Any:
    """PEFT-wrap this rank's shards (`model`, sharded by `shard_llama_`) with this rank's slices of the
    full adapter saved in `adapter_dir`; returns the PEFT model, trainable.

    Raises:
        CheckpointError: if the directory is not a PEFT LoRA adapter of this model's shapes.
    """
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    try:
        config = LoraConfig.from_pretrained(str(adapter_dir))
        full = load_file(str(adapter_dir / "adapter_model.safetensors"))
    except Exception as exc:
        raise CheckpointError(f"could not load the LoRA adapter in {adapter_dir}: {exc}") from exc
    config.inference_mode = False
    peft_model = get_peft_model(model, config, adapter_name=adapter)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" not in name or f".{adapter}." not in name:
                continue
            key = _saved_key(name, adapter)
            if key not in full:
                raise CheckpointError(f"the adapter in {adapter_dir} has no tensor {key}")
            part = tp.slice(full[key], lora_shard_dim(name))
            if part.shape != p.shape:
                raise CheckpointError(f"{key} in {adapter_dir} has shape {tuple(full[key].shape)}; this model's "
                                      f"rank {tp.rank} of {tp.size} needs a slice of shape {tuple(p.shape)}")
            p.copy_(part)
    return peft_model


def full_optimizer_state(optimizer: torch.optim.Optimizer, names: Sequence[str], tp: TensorParallel) -> dict:
    """The optimizer's state_dict with every per-parameter tensor gathered to the full parameter's
    shape (collective), as one GPU's optimizer would hold it, in host memory (each tensor leaves
    the GPU as soon as it is gathered: at 72B the full state is ~0.8 GB, which a GPU close to full
    after a training step need not find). `names`: the parameters' names, in the optimizer's order."""
    state = optimizer.state_dict()
    full = {}
    for index, values in state["state"].items():
        dim = lora_shard_dim(names[index])
        full[index] = {k: tp.gather(v, dim).cpu() if torch.is_tensor(v) and v.dim() > 0 else v
                       for k, v in values.items()}
    return {"state": full, "param_groups": state["param_groups"]}


def shard_optimizer_state(state: dict, names: Sequence[str], tp: TensorParallel) -> dict:
    """The inverse of `full_optimizer_state`: this rank's slices of a full optimizer state_dict."""
    sharded = {}
    for index, values in state["state"].items():
        dim = lora_shard_dim(names[int(index)])
        sharded[index] = {k: tp.slice(v, dim).clone() if torch.is_tensor(v) and v.dim() > 0 else v
                          for k, v in values.items()}
    return {"state": sharded, "param_groups": state["param_groups"]}
