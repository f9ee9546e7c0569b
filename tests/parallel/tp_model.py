"""The tiny model, adapter and data shared by the tensor-parallel tests and their rank script."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from rank_processes import random_sequences

from tempering.training import TokenizedSequence
from tempering.types import TrainConfig

# 4 query heads and 2 KV heads: at tensor_parallel_size 2 each rank holds 2 query heads and 1 KV head
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=211, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 7, 120, 33], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def tiny_llama(qwen2: bool = False, device: str | torch.device = "cpu"):
    """A tiny random Llama (or Qwen2: biased q/k/v), the same weights in every process, on `device`:
    float32 on the CPU and on "cuda-f32", bfloat16 on CUDA and on "cpu-bf16" or "cpu-bf16-spare"
    (the CPU in bfloat16)."""
    import transformers

    device, dtype = placement(device)

    torch.manual_seed(0)
    if qwen2:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    return model.to(device=device, dtype=dtype).requires_grad_(False)


def placement(spec: str | torch.device) -> tuple[torch.device, torch.dtype]:
    """(device, model dtype) of a test's device spec: "cpu" (float32), "cpu-bf16", "cpu-bf16-spare"
    (the engine's spare-rows LoRA path, its default on GPUs), "cuda[:N]" (bfloat16), "cuda[:N]-f32"."""
    if str(spec).startswith("cpu-bf16"):
        return torch.device("cpu"), torch.bfloat16
    if str(spec).endswith("-f32"):
        return torch.device(str(spec)[:-4]), torch.float32
    device = torch.device(spec)
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def full_adapter(seed: int = 1) -> dict[str, torch.Tensor]:
    """A non-zero LoRA (rank 4) on every projection of TINY, full shapes, by PEFT's saved key names."""
    H, I = TINY["hidden_size"], TINY["intermediate_size"]
    D = H // TINY["num_attention_heads"]
    shapes = {"q_proj": (H, TINY["num_attention_heads"] * D), "k_proj": (H, TINY["num_key_value_heads"] * D),
              "v_proj": (H, TINY["num_key_value_heads"] * D), "o_proj": (H, H), "gate_proj": (H, I),
              "up_proj": (H, I), "down_proj": (I, H)}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(TINY["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(4, fan_in, generator=g) * 0.2
            state[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g) * 0.2
    return state


def wrap_with_adapter(model, state: dict[str, torch.Tensor], tp=None):
    """PEFT-wrap `model` (whole, or this rank's shards) with the LoRA `state` (full tensors: sliced for `tp`)."""
    from peft import LoraConfig, get_peft_model

    from tempering.modeling.tensor_parallel import lora_shard_dim

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0),
                          adapter_name="default")
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                full = state[name.replace(".default", "")]
                p.copy_(tp.slice(full, lora_shard_dim(name)) if tp is not None else full)
    return peft


def engine_for(model, peft, tp=None, spare_rows=None):
    """The engine on `model` (its shards with `tp`); `peft`: the PEFT model, or a function returning it
    (an engine made before the trainer, as the service makes them); `spare_rows`: LlamaFamilyModel's
    (None: its default, on GPUs only)."""
    from tempering.engine import Engine, EngineConfig
    from tempering.engine.models import LlamaFamilyModel

    config = EngineConfig(cpu_kv_cache_bytes=4 << 20, num_kv_blocks=256, max_num_seqs=8,
                          tensor_parallel_size=tp.size if tp else 1)
    return Engine(LlamaFamilyModel(model, 256, tp=tp, spare_rows=spare_rows), _IdsOnly(), stop_token_ids=[],
                  lock=threading.RLock(),
                  config=config, peft_model=(lambda: peft) if isinstance(peft, torch.nn.Module) else peft)


class _IdsOnly:
    """The tiny random model has no tokenizer: its completions are compared by token ids, their text left empty."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def generate(engine) -> dict:
    """Greedy completions of PROMPTS (24 tokens) with the base model and with the adapter."""
    from tempering.engine import BasePolicy, SamplingParams
    from tempering.service.policies import AdapterPolicy
    from tempering.training.trainer import ADAPTER_NAME

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = {}
    live = AdapterPolicy(None, ADAPTER_NAME, 1)  # the trainer's live adapter (activating it is a no-op)
    for key, policy in (("base", BasePolicy()), ("lora", live)):
        futures = [engine.submit(p, params, policy=policy) for p in PROMPTS]  # batched together
        completions = [f.result(120)[0] for f in futures]
        out[key] = ([c.token_ids for c in completions], [c.logprobs for c in completions])
    return out


def sequences(seed: int, n: int = 8) -> list[TokenizedSequence]:
    return random_sequences(seed, n, TINY["vocab_size"])


def lora_grads(trainer, seqs: list[TokenizedSequence], tp=None) -> dict[str, torch.Tensor]:
    """Each LoRA tensor's whole gradient (gathered from the shards under TP, on the CPU, float32) of
    a fixed random weighting of the trainer's logprobs of `seqs`, packed in one row; the adapter
    is left as it was (the gradients are cleared)."""
    from tempering.modeling.tensor_parallel import lora_shard_dim
    from tempering.training.batching import pack_sequences

    device = trainer.params[0].device
    (micro,) = pack_sequences(seqs, max_tokens=4096)
    row = micro.row().to(device)
    logprobs, _ = trainer._row_logprobs(row)
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0)).to(device)
    (logprobs.float() * weights).sum().backward()
    if tp is not None:
        tp.all_reduce_replicated_grads(trainer.named_params)
    out = {}
    for name, p in trainer.named_params:
        grad = tp.gather(p.grad, lora_shard_dim(name)) if tp is not None else p.grad
        out[name] = grad.float().cpu()
        p.grad = None
    return out


def config() -> TrainConfig:
    # two mini-batches (two optimizer updates) per step, rows of at most 64 tokens, gradient clipping active
    return TrainConfig(learning_rate=1e-2, batch_size=4, micro_batch_tokens=64, cuda_graphs=False, max_grad_norm=0.5)
