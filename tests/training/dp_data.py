"""The tiny model, adapter and data shared by the data-parallel tests and their rank script."""

from __future__ import annotations

import random
from pathlib import Path

import torch

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
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length, k = rng.randint(12, 40), rng.randint(3, 10)
        out.append(TokenizedSequence(
            [rng.randrange(TINY["vocab_size"]) for _ in range(length)], [False] * (length - k) + [True] * k,
            [float("nan")] * (length - k) + [rng.uniform(-3, -0.5) for _ in range(k)],
            advantage=rng.choice([-1.0, -0.5, 0.5, 1.0]), group_index=i // 4, trajectory_index=i % 4,
        ))
    return out


def config() -> TrainConfig:
    # three shuffled mini-batches (three optimizer updates) per step, rows of at most 64 tokens
    return TrainConfig(learning_rate=1e-2, batch_size=4, micro_batch_tokens=64, cuda_graphs=False)


def sft_batches() -> list[tuple[list[TokenizedSequence], float]]:
    return [(sequences(5, n=6), 1e-2), (sequences(6, n=5), 5e-3)]
