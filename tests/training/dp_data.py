"""The tiny model, adapter and data shared by the data-parallel tests and their rank script."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from rank_processes import random_sequences

from tempering.training import TokenizedSequence, Trainer
from tempering.types import LoRAConfig, TrainConfig

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=211, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True)


def make_trainer(*, seed: int, dp=None, adapter: Path | None = None, device: torch.device | str = "cpu") -> Trainer:
    """A tiny random fp32 Llama (the same base weights everywhere: drawn on the CPU) on `device`,
    with a LoRA whose B is drawn from `seed`."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().to(device)
    model.requires_grad_(False)
    if adapter is not None:
        return Trainer.from_adapter(model, adapter, dp=dp)
    trainer = Trainer.new(model, LoRAConfig(rank=4, alpha=8), seed=7, dp=dp)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.05)
    return trainer


def sequences(seed: int, n: int = 12) -> list[TokenizedSequence]:
    return random_sequences(seed, n, TINY["vocab_size"])


def config() -> TrainConfig:
    # three shuffled mini-batches (three optimizer updates) per step, rows of at most 64 tokens
    return TrainConfig(learning_rate=1e-2, batch_size=4, micro_batch_tokens=64, cuda_graphs=False)


def shared_config(**kwargs) -> TrainConfig:
    # one optimizer update (work sharing needs it), rows of at most 64 tokens: several micro-batches
    return TrainConfig(learning_rate=1e-2, micro_batch_tokens=64, cuda_graphs=False, **kwargs)


def sft_batches() -> list[tuple[list[TokenizedSequence], float]]:
    return [(sequences(5, n=6), 1e-2), (sequences(6, n=5), 5e-3)]
