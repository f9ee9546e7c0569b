"""The whole RL loop on GPUs: register, rollouts through the OpenAI endpoint, train steps, the new
adapter served, and a resume in a new backend.

Builds a Qwen2.5-shaped model (`--shape 1.5b` or `72b`) with random bf16 weights (hub weights
cannot be fetched) that uses the default model's tokenizer and chat template (from
`--tokenizer-dir`; the vocabulary is the tokenizer's 49,152 tokens) as a local Hugging Face
directory, and runs LocalBackend on it: CUDA and bf16 are the defaults when a GPU is present.
With `--load-format dummy` the directory holds the config and tokenizer only, and each GPU draws
its own weights (`EngineConfig(load_format="dummy")`): a 72B shape needs no 145 GB checkpoint.
`--gpus N --tensor-parallel-size N` splits the model over N GPUs. Prints one JSON line with the
timings of each phase (two train steps: on GPU the first captures the trainer's CUDA graphs, the
second replays them) and the resume: a new backend on the same directory registers the model at
its last step and serves the same logprobs.

    python benchmarks/gpu_loop.py --tokenizer-dir ~/.cache/tempering/models/SmolLM2-135M-Instruct
    python benchmarks/gpu_loop.py --tokenizer-dir DIR --shape 72b --load-format dummy --gpus 4 --tensor-parallel-size 4 \
        --gpu-memory-fraction 0.25
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


SHAPES = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, tie_word_embeddings=False),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),  # a quick smoke test on CPU
}


def build_model_dir(tokenizer_dir: Path, out: Path, *, shape: str = "1.5b", weights: bool = True) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        **SHAPES[shape],
        vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"], eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if weights:
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    else:  # config and tokenizer only: load_format="dummy" draws the weights where they live
        config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def run(base_model: Path, root: Path, group_size: int, num_groups: int, *, gpus: int = 1,
              engine: dict | None = None, shape: str = "1.5b", device: str | None = None) -> dict:
    import tempering as art

    times = {}
    model = art.TrainableModel(name="gpu-loop", project="bench", base_model=str(base_model))
    backend = art.LocalBackend(path=root, gpus=gpus, engine_config=engine, device=device)
    start = time.perf_counter()
    await model.register(backend)
    times["register_s"] = time.perf_counter() - start
    service = backend._registry.get(model.name)
    # what the report needs, read now: a reference to the service kept to the end would keep its
    # weights on GPU 0 through the resume (at the 72B shape rank 0 then ran out of memory there)
    served = {"device": str(service.device), "dtype": str(service.dtype), "engine": type(service.engine).__name__}
    del service
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
    last = await probe_logprobs(model.name)
    await backend.close()
    # the resume: a new backend on the same directory, the model at its last step
    backend = art.LocalBackend(path=root, gpus=gpus, engine_config=engine, device=device)
    model = art.TrainableModel(name="gpu-loop", project="bench", base_model=str(base_model))
    start = time.perf_counter()
    await model.register(backend)
    times["resume_register_s"] = time.perf_counter() - start
    resumed_step = await model.get_step()
    client = model.openai_client()
    resumed = await probe_logprobs(model.name)
    await backend.close()
    return {
        "benchmark": "gpu_loop",
        **served,
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": f"Qwen2.5-{shape}-shaped random weights (SmolLM2 tokenizer, vocabulary 49,152)",
        "gpus": gpus, "engine_config": engine,
        "rollouts": group_size * num_groups,
        "step_after_train": result.step,
        "step_after_second_train": second.step,
        "train_metrics": {k: round(v, 4) for k, v in result.metrics.items() if k.startswith(("loss/", "data/", "train/reward"))},
        "policy_changed": max(abs(a - b) for a, b in zip(before, after)) > 1e-3,
        "step0_still_served": max(abs(a - b) for a, b in zip(before, at_zero)) < 5e-2,
        "resumed_step": resumed_step,
        "resumed_max_logprob_diff": max(abs(a - b) for a, b in zip(last, resumed)),
        **{k: round(v, 3) for k, v in times.items()},
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--small", action="store_true", help="--shape small (a smoke test)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: no weights file; each GPU draws its weights (EngineConfig.load_format)")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu for a smoke test of --gpus N on CPU processes")
    parser.add_argument("--gpu-memory-fraction", type=float, default=None,
                        help="EngineConfig.gpu_memory_fraction: the KV cache's share of the memory free after the "
                             "weights (default 0.5; 0.25 leaves a 72B shape's training its activations)")
    args = parser.parse_args()
    shape = "small" if args.small else args.shape
    engine = {"load_format": args.load_format, "tensor_parallel_size": args.tensor_parallel_size}
    if args.gpu_memory_fraction is not None:
        engine["gpu_memory_fraction"] = args.gpu_memory_fraction
    with tempfile.TemporaryDirectory() as tmp:
        base = build_model_dir(args.tokenizer_dir, Path(tmp) / "model", shape=shape,
                               weights=args.load_format == "auto")
        record = asyncio.run(run(base, Path(tmp) / "runs", args.group_size, args.num_groups, gpus=args.gpus,
                                 engine=engine, shape=shape, device=args.device))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
