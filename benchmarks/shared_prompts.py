"""RL step with the group's shared prompt held once per row, against every trajectory computed whole.

Prints one JSON line. RL groups share their prompt (system prompt, tools, worked examples, the
question): `--groups` groups × `--group-size` trajectories, each a `--prompt`-token prompt
common to its group followed by `--completion` sampled tokens (random ids; the trained tokens
and advantages as an RL step has them). `Trainer.step` runs on the same sequences with
`trainer.share_prompts` on and off, alternating (on, off, off, on, ...: `--rounds` of each),
after one warm-up step of each, at learning rate 1e-12 so that every step sees the same adapter and
the two modes' losses must agree. Reported: seconds per step, trajectory tokens per second (all
tokens of all sequences, shared or not), the ratio, and the loss of each mode.

    python benchmarks/shared_prompts.py                          # default model, CPU
    python benchmarks/shared_prompts.py --prompt 600 --completion 150 --groups 3 --group-size 4
    python benchmarks/shared_prompts.py --device cuda --groups 32 --group-size 8 --prompt 1536 --completion 256

On a GPU the model is Qwen2.5-1.5B-shaped with random bf16 weights (rollout.py's), and both modes
run from CUDA graphs (the trainer's default there); `--also-eager` adds the shared mode without them.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from tempering.training import TokenizedSequence, Trainer
from tempering.types import LoRAConfig, TrainConfig


def make_sequences(args, vocab: int) -> list[TokenizedSequence]:
    g = torch.Generator().manual_seed(0)
    out = []
    for group in range(args.groups):
        prompt = torch.randint(100, vocab - 100, (args.prompt,), generator=g).tolist()
        advantages = torch.randn(args.group_size, generator=g)
        advantages -= advantages.mean()
        for i in range(args.group_size):
            completion = torch.randint(100, vocab - 100, (args.completion,), generator=g).tolist()
            sampled = (-torch.rand(args.completion, generator=g) * 3).tolist()
            out.append(TokenizedSequence(prompt + completion, [False] * args.prompt + [True] * args.completion,
                                         [float("nan")] * args.prompt + sampled, advantage=float(advantages[i]),
                                         group_index=group, trajectory_index=i))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--completion", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--also-eager", action="store_true", help="GPU: also the shared mode without CUDA graphs")
    args = parser.parse_args()
    device = torch.device(args.device)

    if device.type == "cuda":
        from rollout import build_gpu_model

        model, _ = build_gpu_model(device)
        model_name, machine = "Qwen2.5-1.5B-shaped random bf16", torch.cuda.get_device_name(device)
    else:
        from transformers import AutoModelForCausalLM

        from tempering.service.base_model import default_model_dir

        model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
        model_name, machine = "SmolLM2-135M-Instruct float32", f"{platform.machine()} x{torch.get_num_threads()} threads"
    trainer = Trainer.new(model, LoRAConfig(rank=8, alpha=16))
    with torch.no_grad():  # B = 0 would make the adapter a no-op
        for name, p in trainer.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    sequences = make_sequences(args, model.config.vocab_size)
    config = TrainConfig(learning_rate=1e-12)  # > 0 is required; the adapter stays as it is
    tokens = sum(len(s) for s in sequences)
    modes = {"shared": (True, config), "whole": (False, config)}
    if args.also_eager and device.type == "cuda":
        modes["shared_eager"] = (True, config.model_copy(update={"cuda_graphs": False}))
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    for share, mode_config in modes.values():  # warm-up (captures the graphs)
        trainer.share_prompts = share
        trainer.step(sequences, mode_config)
    for r in range(args.rounds):  # alternating, so that a drifting machine favours no mode
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            share, mode_config = modes[mode]
            trainer.share_prompts = share
            start = time.perf_counter()
            metrics = trainer.step(sequences, mode_config)  # reads its statistics back: the step is done
            seconds[mode].append(time.perf_counter() - start)
            losses[mode].append(metrics.values["loss/train"])
    mean = {k: sum(v) / len(v) for k, v in seconds.items()}
    record = {
        "benchmark": "shared_prompts", "device": args.device, "machine": machine, "model": model_name,
        "torch": torch.__version__,
        "groups": args.groups, "group_size": args.group_size, "prompt": args.prompt, "completion": args.completion,
        "trajectory_tokens": tokens,
        "speedup": round(mean["whole"] / mean["shared"], 2),
    }
    for mode in modes:
        record[f"{mode}_s"] = round(mean[mode], 3)
        record[f"{mode}_tok_per_s"] = round(tokens / mean[mode], 1)
        record[f"{mode}_runs_s"] = [round(x, 3) for x in seconds[mode]]
        record[f"loss_{mode}"] = losses[mode][0]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
