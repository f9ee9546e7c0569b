"""The whole RL loop on a GPU: rollouts through the OpenAI endpoint, a train step, the new adapter served.

Builds a Qwen2.5-1.5B-shaped model with random bf16 weights (hub weights cannot be fetched) that
uses the default model's tokenizer and chat template (from `--tokenizer-dir`), saves it as a local
Hugging Face directory, and runs LocalBackend on it: CUDA and bf16 are the defaults when a GPU is
present. Prints one JSON line with the timings of each phase (two train steps: on GPU the first captures
the trainer's CUDA graphs, the second replays them).

    python benchmarks/gpu_loop.py --tokenizer-dir ~/.cache/tempering/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

import torch


def build_model_dir(tokenizer_dir: Path, out: Path, *, small: bool = False) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2)
    if small:  # a quick smoke test of this script on CPU
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config = Qwen2Config(
        **shape,
        vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"], eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def run(base_model: Path, root: Path, group_size: int, num_groups: int) -> dict:
    import tempering as art

    times = {}
    model = art.TrainableModel(name="gpu-loop", project="bench", base_model=str(base_model))
    backend = art.LocalBackend(path=root)
    start = time.perf_counter()
    await model.register(backend)
    times["register_s"] = time.perf_counter() - start
    service = backend._registry.get(model.name)
    client = model.openai_client()
    probe = [{"role": "user", "content": "Say something."}]

    async def probe_logprobs(name):
        c = await client.chat.completions.create(model=name, messages=probe, max_tokens=8, temperature=0)
        return list(c.choices[0].sampled_logprobs)

    async def rollout(i):
        traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": f"Question {i}: what comes next?"}])
        c = await client.chat.completions.create(model=model.name, messages=traj.messages(), max_tokens=32, temperature=1.0)
        choice = c.choices[0]
        traj.messages_and_choices.append(choice)
        lps = choice.sampled_logprobs
        traj.reward = math.exp(sum(lps) / len(lps))  # varies between samples
        return traj

    before = await probe_logprobs(model.name)
    start = time.perf_counter()
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(g) for _ in range(group_size)) for g in range(num_groups)), pbar_desc=None
    )
    times["gather_s"] = time.perf_counter() - start
    start = time.perf_counter()
    result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
    times["train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    after = await probe_logprobs(model.name)
    times["first_request_after_train_s"] = time.perf_counter() - start
    at_zero = await probe_logprobs(f"{model.name}@0")
    # a second step: on GPU the first one captured the trainer's CUDA graphs, this one replays them
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(g) for _ in range(group_size)) for g in range(num_groups)), pbar_desc=None
    )
    start = time.perf_counter()
    second = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
    times["second_train_s"] = time.perf_counter() - start
    await backend.close()
    return {
        "benchmark": "gpu_loop",
        "device": str(service.device),
        "dtype": str(service.dtype),
        "engine": type(service.engine).__name__,
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": "Qwen2.5-1.5B-shaped random bf16 (SmolLM2 tokenizer)",
        "rollouts": group_size * num_groups,
        "step_after_train": result.step,
        "step_after_second_train": second.step,
        "train_metrics": {k: round(v, 4) for k, v in result.metrics.items() if k.startswith(("loss/", "data/", "train/reward"))},
        "policy_changed": max(abs(a - b) for a, b in zip(before, after)) > 1e-3,
        "step0_still_served": max(abs(a - b) for a, b in zip(before, at_zero)) < 5e-2,
        **{k: round(v, 3) for k, v in times.items()},
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = build_model_dir(args.tokenizer_dir, Path(tmp) / "model", small=args.small)
        record = asyncio.run(run(base, Path(tmp) / "runs", args.group_size, args.num_groups))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
