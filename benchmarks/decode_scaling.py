"""What a decode step costs as the batch shrinks: the bound on splitting a fixed RL batch over GPUs.

Data-parallel replicas split a fixed batch (rollout.py --gpus N): each GPU then decodes 1/N of the
rows, and the batch finishes no sooner than one GPU takes for 1/N of it alone. This script measures
that on one GPU: workload R (n=8 samples of 128-token random prompts, 256 new tokens, the live
rank-8 LoRA, Qwen2.5-1.5B-shaped random bf16 weights) at 32, 16, 8 and 4 prompts (256 to 32 rows),
each timed after a full-length warm-up, then a window of steady decoding profiled (torch.profiler):
the wall time per step, the fraction of it the GPU ran kernels, the kernel time and count per step,
and the longest kernels. Prints one JSON line.

`--workload long` does the same for the long workload (n=8, 2,048 new tokens) at 64, 32 and 16
prompts (512 to 128 rows), profiling once each sample has decoded `--profile-after` tokens (1,024 by
default: attention then reads half the keys it reads at the end); `--max-num-seqs 512` lets one
step hold all 512 rows (the engine's default of 256 runs them as two waves).

    python benchmarks/decode_scaling.py                                    # CUDA, R
    python benchmarks/decode_scaling.py --workload long --max-num-seqs 512
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from rollout import GPU_WORKLOADS, add_live_adapter, build_gpu_model, machine, make_prompts, sync, time_engine  # noqa: E402

from tempering.engine import Engine, EngineConfig, SamplingParams, engine_model_for  # noqa: E402
from tempering.service.policies import AdapterPolicy  # noqa: E402


class _Tokenizer:  # random weights: no text; EOS ignored
    def decode(self, ids, skip_special_tokens=True):
        return ""


def profile_decoding(engine: Engine, prompts: list[list[int]], n: int, policy, max_new: int, after: int,
                     window_s: float = 0.25) -> dict:
    """Kernel time and count per step over a window of steady decoding (after `after` tokens per sample)."""
    engine.blocks.forget_cached()
    params = SamplingParams(max_tokens=max_new, temperature=1.0, ignore_eos=True)
    decoded = engine.stats.num_decode_tokens
    futures = [engine.submit(p, params, n=n, policy=policy) for p in prompts]
    while engine.stats.num_decode_tokens < decoded + len(prompts) * n * after:
        time.sleep(0.0005)
    steps = engine.stats.num_steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sync(engine.device)
        start = time.perf_counter()
        time.sleep(window_s)
        sync(engine.device)
        wall = time.perf_counter() - start
    steps = max(engine.stats.num_steps - steps, 1)
    for f in futures:
        f.result()
    kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    kernel_us = sum(e.self_device_time_total for e in kernels)
    return {"gpu_busy": round(kernel_us / 1e6 / wall, 3), "wall_us_per_step": round(wall * 1e6 / steps, 1),
            "kernel_us_per_step": round(kernel_us / steps, 1),
            "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1),
            "top_kernels_us_per_step": {e.key[:60]: round(e.self_device_time_total / steps, 1) for e in kernels[:12]}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="R", choices=["R", "long"])
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the engine's max_num_seqs and max_graph_batch_size")
    parser.add_argument("--profile-after", type=int, default=None, help="tokens per sample decoded before the profiled window")
    args = parser.parse_args()
    counts = (32, 16, 8, 4) if args.workload == "R" else (64, 32, 16)
    after = args.profile_after or (16 if args.workload == "R" else 1024)
    device = torch.device("cuda", 0)
    model, _ = build_gpu_model(device)
    holder = {"peft": None}
    engine = Engine(engine_model_for(model, 4096), _Tokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                    config=EngineConfig(max_num_seqs=args.max_num_seqs, max_graph_batch_size=args.max_num_seqs,
                                        max_num_batched_tokens=8192), max_seq_len=4096,
                    peft_model=lambda: holder["peft"])
    trainer = add_live_adapter(model)
    holder["peft"] = trainer.peft_model
    policy = AdapterPolicy(trainer.peft_model, "default", 1)
    record: dict = {"benchmark": "decode_scaling", "machine": machine(device), "torch": torch.__version__,
                    "model": "Qwen2.5-1.5B-shaped random bf16, live LoRA r8", "workload": args.workload,
                    "max_num_seqs": args.max_num_seqs, "profile_after_tokens": after, "batches": {}}
    try:
        for count in counts:
            work = dict(GPU_WORKLOADS[args.workload], num_prompts=count)
            prompts = make_prompts(count, None, model.config.vocab_size, seed=count)
            seconds, _ = time_engine(engine, prompts, work, policy, full_warm=True)
            rows = count * work["n"]
            record["batches"][rows] = {"s": round(seconds, 3), "ms_per_step": round(seconds / (work["max_new"] + 1) / -(-rows // args.max_num_seqs) * 1e3, 2),
                                       "tok_per_s": round(rows * work["max_new"] / seconds, 1),
                                       **profile_decoding(engine, prompts, work["n"], policy, work["max_new"], after)}
    finally:
        engine.close()
    rows = [c * GPU_WORKLOADS[args.workload]["n"] for c in counts]
    full = record["batches"][rows[0]]["s"]
    record["bound_ratio_replicas"] = {rows[0] // r: round(full / record["batches"][r]["s"], 2) for r in rows[1:]}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
