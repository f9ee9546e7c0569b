"""Does the real default model learn? The demo's task, per seed, with the numbers that say why or why not.

Runs `tempering demo`'s loop (SmolLM2-135M-Instruct, addition, 12 steps of 4 problems × 8
rollouts at temperature 0.7, validation on 64 held-out problems × 2 samples) once per seed, each
in a fresh directory, and prints one JSON line with, per seed:

- `val_before`, `val_after`, `gain`: the validation reward before the first step and after the last;
- `mismatch_mean`, `mismatch_p99`: per step, |engine logprob − trainer logprob| of the sampled
  tokens before the step's first update (mean, and the upper edge of the histogram bin holding
  the 99th percentile), as `offpolicy/mismatch_abs_logprob[_p99]` in history.jsonl;
- `grad_norm_median`, `grad_norm_max`: over the run's steps;
- `micro_batches`, `micro_batches_shared`: per step, the step's micro-batches and those another
  rank computed (work sharing in dedicated mode, `--gpus N --dedicated`);
- `seconds`, and an `error` instead of the figures when a seed's run fails;

and over seeds the mean gain, the smallest gain, the largest per-step mismatch mean and p99,
and the largest ratio of a step's gradient norm to its run's median.

    python benchmarks/learning.py                            # CPU, float32, seeds 0-4
    python benchmarks/learning.py --device cuda --seeds 0 1 2 3 4
    python benchmarks/learning.py --device cuda --batch-invariant     # exact on-policy
    python benchmarks/learning.py --device cuda --dtype float32       # the float32 reference on a GPU
    python benchmarks/learning.py --device cuda --base-model gemma-3-270m --task repeat-word
    python benchmarks/learning.py --device cuda --gpus 2 --dedicated --train-option micro_batch_tokens=256
        # GPU 0 trains, GPU 1 serves and computes part of each step (work sharing): small micro-batches
        # give a step of the demo several to share
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def one_seed(seed: int, root: Path, device: str | None, train_options: dict, batch_invariant: bool,
                   dtype: str | None = None, gpus: int = 1, dedicated: bool = False,
                   base_model: str | None = None, task: str | None = None) -> dict:
    from tempering.demo.run import run_demo_async
    from tempering.storage import read_history

    start = time.perf_counter()
    result = await run_demo_async(path=root, seed=seed, name=f"learning-{seed}", device=device,
                                  train_options=train_options or None, echo=lambda line: None,
                                  engine_config={"batch_invariant": True} if batch_invariant else None, dtype=dtype,
                                  gpus=gpus, dedicated=dedicated, task=task,
                                  **({"base_model": base_model} if base_model else {}))
    rows = [r for r in read_history(result.history_path) if "loss/grad_norm" in r or "offpolicy/mismatch_abs_logprob" in r]
    mismatch = [r["offpolicy/mismatch_abs_logprob"] for r in rows if r.get("offpolicy/mismatch_abs_logprob") is not None]
    p99 = [r["offpolicy/mismatch_abs_logprob_p99"] for r in rows
           if r.get("offpolicy/mismatch_abs_logprob_p99") is not None]
    norms = [r["loss/grad_norm"] for r in rows if r.get("loss/grad_norm") is not None and math.isfinite(r["loss/grad_norm"])]
    median = statistics.median(norms) if norms else math.nan
    return {
        "seed": seed, "val_before": result.val_reward_before, "val_after": result.val_reward_after,
        "gain": result.improvement, "val_rewards": result.val_rewards,
        "mismatch_mean": mismatch, "mismatch_p99": p99,
        "grad_norm_median": median, "grad_norm_max": max(norms, default=math.nan),
        "grad_norm_max_over_median": max(norms, default=math.nan) / median if norms else math.nan,
        "updates_skipped": sum(int(r.get("loss/num_updates_skipped") or 0) for r in rows),
        "bitwise_equal_fraction": [r.get("offpolicy/bitwise_equal_fraction") for r in rows],
        "micro_batches": [r.get("data/step_micro_batches") for r in rows if "loss/grad_norm" in r],
        "micro_batches_shared": [r.get("data/step_micro_batches_shared") for r in rows if "loss/grad_norm" in r],
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when available)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--train-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a TrainConfig field for every step, e.g. loss_fn=cispo (repeatable)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="exact on-policy: the engine's batch-invariant mode (EngineConfig.batch_invariant)")
    parser.add_argument("--dtype", default=None,
                        help="the model's dtype (default: the service's, float32 for this 135M model; bfloat16: "
                             "the half-precision path larger models take)")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                        help="torch.set_float32_matmul_precision for a float32 model: highest = exact float32 "
                             "products, high = TF32 tensor cores (cuBLAS and the engine's Triton kernels alike)")
    parser.add_argument("--gpus", type=int, default=1, help="LocalBackend(gpus=N): one process per GPU")
    parser.add_argument("--dedicated", action="store_true",
                        help="with --gpus > 1: GPU 0 trains, the others serve and share each step's micro-batches")
    parser.add_argument("--base-model", default=None,
                        help="the model to train (default: the demo's, SmolLM2-135M-Instruct), e.g. gemma-3-270m")
    parser.add_argument("--task", default=None,
                        help="the demo's task: addition, or repeat-word for a pretrained model (default: the "
                             "model's own, repeat-word for gemma-3-270m, else addition)")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    from tempering.demo.run import default_task
    from tempering.service.base_model import DEFAULT_BASE_MODEL

    args.task = args.task or default_task(args.base_model or DEFAULT_BASE_MODEL)
    options = dict((k, _value(v)) for k, v in (o.split("=", 1) for o in args.train_option))
    runs = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                runs.append(asyncio.run(one_seed(seed, Path(tmp), args.device, options, args.batch_invariant,
                                                 args.dtype, args.gpus, args.dedicated, args.base_model,
                                                 args.task)))
            except Exception as exc:  # a failed seed is a result too
                runs.append({"seed": seed, "error": f"{type(exc).__name__}: {exc}"})
    done = [r for r in runs if "error" not in r]
    gains = [r["gain"] for r in done]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(json.dumps({
        "benchmark": "learning", "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "train_options": options, "batch_invariant": args.batch_invariant, "dtype": args.dtype,
        "matmul_precision": args.matmul_precision, "seeds": args.seeds, "gpus": args.gpus,
        "dedicated": args.dedicated, "base_model": args.base_model, "task": args.task,
        "micro_batches_shared": sum(m or 0 for r in done for m in r["micro_batches_shared"]),
        "micro_batches": sum(m or 0 for r in done for m in r["micro_batches"]),
        "mean_gain": statistics.mean(gains) if gains else None, "min_gain": min(gains, default=None),
        "num_failed": len(runs) - len(done),
        "max_mismatch_mean": max((m for r in done for m in r["mismatch_mean"]), default=None),
        "max_mismatch_p99": max((m for r in done for m in r["mismatch_p99"]), default=None),
        "max_grad_norm_over_median": max((r["grad_norm_max_over_median"] for r in done), default=None),
        "min_bitwise_equal_fraction": min((f for r in done for f in r["bitwise_equal_fraction"] if f is not None),
                                          default=None),
        "runs": runs,
    }))


if __name__ == "__main__":
    main()
