"""The host work of a gather through the OpenAI endpoint, with the engine's work taken out.

An RL batch's rollouts reach the engine as HTTP requests and leave it as JSON responses: the
client (the openai SDK) builds and sends each request, the server renders and tokenizes the chat
prompt, and after sampling decodes the completion, remembers the turn and serializes the choice
(token ids and sampled logprobs included), which the client parses. On a GPU that host work is
a real part of a gather: on an H100 256 rollouts of 1,024 tokens waited 1.85 s for their first
token and 1.05 s after their last (rl_loop.py, 2026-11-26), beside 5.7 s of decoding.

This script measures it alone: a tiny random model (the default model's tokenizer and chat
template, 2 layers) is registered with `LocalBackend` on the CPU, and its engine's `submit` is
replaced by one that answers at once with `--new-tokens` random tokens per sample. Then
`--rollouts` concurrent chat completions (`--prompt-tokens`-token prompts, groups of 8, as
`rl_loop.py` sends them) go through `model.openai_client()` and `gather_trajectory_groups`,
`--iterations` times. Baseline in the same run: the same completions submitted to the model's
service directly (no HTTP, no chat rendering, no serialization). Prints one JSON line: seconds per
gather (each run and the median), when the first and the last request reached the engine, and
the baseline.

    python benchmarks/endpoint_overhead.py                       # 256 rollouts x 1,024 tokens
    python benchmarks/endpoint_overhead.py --rollouts 64 --new-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_loop import build_model_dir  # noqa: E402
from rl_loop import make_prompts  # noqa: E402

import tempering as art  # noqa: E402
from tempering.engine import SamplingParams  # noqa: E402
from tempering.engine.request import Completion  # noqa: E402
from tempering.service.base_model import default_model_dir  # noqa: E402


async def run(args) -> dict:
    root = Path(tempfile.mkdtemp())
    model_dir = build_model_dir(default_model_dir(), root / "model", shape="small")
    model = art.TrainableModel(name="endpoint", project="bench", base_model=str(model_dir))
    backend = art.LocalBackend(path=root / "runs", device="cpu")
    await model.register(backend)
    service = backend._registry.get(model.name)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 20000) for _ in range(args.new_tokens)]
    text = service.tokenizer.decode(ids, skip_special_tokens=True)
    arrivals: list[float] = []

    def instant_submit(prompt_ids, params, *, n=1, policy=None, on_token=None):
        """The engine's answer, at once: n samples of the same random tokens."""
        arrivals.append(time.perf_counter())
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result([Completion(token_ids=list(ids), logprobs=[-1.5] * len(ids), top_logprobs=[[]] * len(ids),
                                      text=text, finish_reason="length", logprob_temperature=1.0,
                                      policy_versions=[0] * len(ids)) for _ in range(n)])
        return future

    service.engine.submit = instant_submit
    prompts = make_prompts(service.tokenizer, service.renderer, args.rollouts, args.prompt_tokens)
    client = model.openai_client()

    async def rollout(prompt: str) -> art.Trajectory:
        traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
        completion = await client.chat.completions.create(
            model=model.name, messages=traj.messages(), max_tokens=args.new_tokens, temperature=1.0,
            extra_body={"ignore_eos": True})
        traj.messages_and_choices.append(completion.choices[0])
        traj.reward = rng.random()
        return traj

    async def gather() -> dict:
        arrivals.clear()
        start = time.perf_counter()
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(prompts[g * 8 + j]) for j in range(8)) for g in range(args.rollouts // 8)),
            pbar_desc=None)
        assert sum(len(g) for g in groups) == args.rollouts
        return {"s": time.perf_counter() - start, "first_request_s": arrivals[0] - start,
                "last_request_s": arrivals[-1] - start}

    await gather()  # warm-up: connections, the template, the first responses
    runs = [await gather() for _ in range(args.iterations)]

    # baseline: the same completions from the service itself
    prompt_ids = [service.renderer.render_prompt([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    direct = []
    for _ in range(args.iterations):
        start = time.perf_counter()
        futures = [service.submit(p, params, n=1, step=None) for p in prompt_ids]
        assert all(len(f.result()) == 1 for f in futures)
        direct.append(time.perf_counter() - start)
    await backend.close()
    median = statistics.median(r["s"] for r in runs)
    return {
        "benchmark": "endpoint_overhead",
        "machine": f"{platform.machine()} x{torch.get_num_threads()} threads",
        "workload": {"rollouts": args.rollouts, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
                     "engine": "instant (answers at once)"},
        "gather_s_runs": [round(r["s"], 3) for r in runs],
        "gather_s_median": round(median, 3),
        "ms_per_rollout": round(1e3 * median / args.rollouts, 2),
        "first_request_reached_engine_s": [round(r["first_request_s"], 3) for r in runs],
        "last_request_reached_engine_s": [round(r["last_request_s"], 3) for r in runs],
        "baseline_direct_submit_s_median": round(statistics.median(direct), 4),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=256, help="concurrent chat completions (a multiple of 8)")
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    if args.rollouts % 8:
        parser.error("--rollouts must be a multiple of 8 (groups of 8)")
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
