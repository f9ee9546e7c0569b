"""Loading a Llama-family checkpoint as one rank's tensor-parallel shards, read slice by slice.

The model is built on the meta device from its config; every tensor of the checkpoint's
safetensors files is then read on the host as this rank's slice only (`safe_open(...).get_slice`
reads the slice's bytes, never the whole matrix) and moved to the device, so a rank's memory
(host and device) never holds more than its shards plus the replicated embedding, LM head and
norms. The layout is modeling/tensor_parallel.py's (`shard_llama_` gives the same shards from a loaded model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..modeling.tensor_parallel import COLUMN_PARALLEL, ROW_PARALLEL, TensorParallel, _check_config

__all__ = ["dummy_model", "load_llama_shards"]


def _shard_dim(name: str) -> int | None:
    """0: a column-parallel weight or bias (output rows); 1: a row-parallel weight (input columns); None: replicated."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in COLUMN_PARALLEL:
        return 0
    if len(parts) >= 2 and parts[-2] in ROW_PARALLEL:
        if parts[-1] == "bias":
            raise ConfigError(f"tensor parallelism does not cover a bias on a row-parallel layer ({name}); "
                              "run this model with tensor_parallel_size 1")
        return 1
    return None


def load_llama_shards(model_dir: str | Path, tp: TensorParallel, device: torch.device, dtype: torch.dtype) -> Any:
    """This rank's shards of the Llama-family model in `model_dir` (config.json + *.safetensors), on `device`.

    Returns:
        the `*ForCausalLM` module, frozen, holding the rank's shards (modeling/tensor_parallel.py) and whole
        replicated tensors, with its generation config.

    Raises:
        ConfigError: if `model_dir` is not a local directory of safetensors files, the sizes do not
            divide by `tp.size`, or a tensor the model needs is missing.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not model_dir.is_dir() or not files:
        raise ConfigError(f"tensor parallelism loads a model from a local directory of .safetensors files; {model_dir} "
                          "is not one (download it first, e.g. `hf download <id> --local-dir DIR`)")
    config = AutoConfig.from_pretrained(model_dir)
    _check_config(config, tp.size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    modules = dict(model.named_modules())
    wanted = {name for name, _ in model.named_parameters()}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in wanted:
                    continue
                dim = _shard_dim(key)
                piece = f.get_slice(key)
                if dim is None:
                    tensor = piece[:]
                else:
                    n = piece.get_shape()[dim] // tp.size
                    rows = slice(tp.rank * n, (tp.rank + 1) * n)
                    tensor = piece[rows] if dim == 0 else piece[:, rows]
                module_name, attr = key.rsplit(".", 1)
                module = modules[module_name]
                setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
                if isinstance(module, nn.Linear) and attr == "weight":
                    module.out_features, module.in_features = module.weight.shape
                wanted.discard(key)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
        wanted.discard("lm_head.weight")
    if wanted:
        raise ConfigError(f"{model_dir} lacks {len(wanted)} tensors of the model, e.g. {sorted(wanted)[:3]}")
    return _finish(model, config, device, model_dir, "tensor-parallel loading",
                   "run this model with tensor_parallel_size 1")


def _finish(model: Any, config: Any, device: torch.device, model_dir: Path | None, what: str, fix: str) -> Any:
    """A model built on the meta device whose tensors are now all on `device`: its buffers computed at
    construction (rotary inverse frequencies) made there, its generation config read, frozen.

    Raises:
        ConfigError: if a tensor is still on the meta device (`what` did not build it; `fix` says what to do).
    """
    from transformers import GenerationConfig

    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConfigError(f"{what} does not know how to build {left[:3]} of {type(model).__name__}: {fix}")
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval().requires_grad_(False)


def dummy_model(model_dir: str | Path | Any, device: torch.device, dtype: torch.dtype, *,
                tp: TensorParallel | None = None, seed: int = 0) -> Any:
    """A model of `model_dir`'s config (no weights read; or a `PretrainedConfig` itself) with random
    weights drawn on `device` (`EngineConfig(load_format="dummy")`): this rank's shards under `tp`, drawn shard by shard so
    the whole model never exists anywhere; every matrix normal with std 0.02, norms 1, biases 0.
    The replicated tensors (embedding, LM head) are the same on every rank; the draws depend only
    on `seed`, the rank and the layout.

    Raises:
        ConfigError: under `tp`, if the sizes do not divide by `tp.size`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(model_dir, (str, Path)):
        model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
    else:
        model_dir, config = None, model_dir
    # replicated tensors (embedding, LM head) the same on every rank; each rank's shards its own
    replicated = torch.Generator(device=device).manual_seed(seed)
    shards = torch.Generator(device=device).manual_seed(seed + 1 + (tp.rank if tp is not None else 0))

    def init(shape: tuple[int, ...], dtype_: torch.dtype, generator: torch.Generator = shards) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype_, device=device).normal_(0.0, 0.02, generator=generator)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if tp is not None:
        from ..modeling.tensor_parallel import shard_llama_

        shard_llama_(model, tp, init=init)
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_meta:
                    if "norm" in type(module).__name__.lower():
                        value = torch.ones(p.shape, dtype=p.dtype, device=device)
                    elif p.dim() > 1:
                        value = init(tuple(p.shape), p.dtype, replicated)
                    else:
                        value = torch.zeros(p.shape, dtype=p.dtype, device=device)
                    setattr(module, name, nn.Parameter(value, requires_grad=False))
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    return _finish(model, config, device, model_dir, "drawing random weights (load_format='dummy')",
                   "use load_format='auto'")
