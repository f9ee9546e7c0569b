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
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tempering.service.base_model import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    trainer = Trainer.new(model, LoRAConfig(rank=8, alpha=16))
    with torch.no_grad():  # B = 0 would make the adapter a no-op
        for name, p in trainer.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    sequences = make_sequences(args, model.config.vocab_size)
    config = TrainConfig(learning_rate=1e-12)  # > 0 is required; the adapter stays as it is
    tokens = sum(len(s) for s in sequences)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {True: [], False: []}
    for share in (True, False):  # warm-up
        trainer.share_prompts = share
        trainer.step(sequences, config)
    for r in range(args.rounds):
        for share in (True, False) if r % 2 == 0 else (False, True):
            trainer.share_prompts = share
            start = time.perf_counter()
            metrics = trainer.step(sequences, config)
            seconds[share].append(time.perf_counter() - start)
            losses[share].append(metrics.values["loss/train"])
    mean = {k: sum(v) / len(v) for k, v in seconds.items()}
    print(json.dumps({
        "benchmark": "shared_prompts", "device": "cpu", "machine": f"{platform.machine()} x{torch.get_num_threads()} threads",
        "model": "SmolLM2-135M-Instruct float32", "torch": torch.__version__,
        "groups": args.groups, "group_size": args.group_size, "prompt": args.prompt, "completion": args.completion,
        "trajectory_tokens": tokens,
        "shared_s": round(mean[True], 2), "whole_s": round(mean[False], 2),
        "shared_tok_per_s": round(tokens / mean[True], 1), "whole_tok_per_s": round(tokens / mean[False], 1),
        "speedup": round(mean[False] / mean[True], 2),
        "shared_runs_s": [round(x, 2) for x in seconds[True]], "whole_runs_s": [round(x, 2) for x in seconds[False]],
        "loss_shared": losses[True][0], "loss_whole": losses[False][0],
    }))


if __name__ == "__main__":
    main()
