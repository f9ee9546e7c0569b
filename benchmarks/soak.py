"""A long RL run: do memory, files, threads, disk, step time and request latency stay flat?

The demo's task and model (`tempering demo`: addition, SmolLM2-135M-Instruct) train through a
`LocalBackend` for `--steps` steps (or until `--minutes` have passed), with the default checkpoint
retention, while a background client sends one chat completion every `1 / --rate` seconds
(a thread of its own, its own HTTP connection, fixed schedule: a late request is sent at once,
never bunched up). Every `--sample-every` steps it samples:

- rss_bytes: this process's resident memory (the server, engine and trainer all run in it);
- gpu_allocated_bytes, gpu_reserved_bytes: PyTorch's CUDA allocator (null on a CPU);
- open_fds, threads: from /proc/self;
- run_dir_bytes, checkpoints_bytes: the model's directory, and its checkpoints alone;
- step_s: the mean wall-clock of the steps since the last sample (gather + train);
- bg_p50_s, bg_p99_s: the background requests answered since the last sample.

It prints one JSON line: each quantity's first and last value and its least-squares slope per 100
steps (also as a fraction of its mean), and a verdict against these limits (the 1,000-step GPU
targets; a shorter run scales the windows to the same fractions of the run):

- rss_bytes, gpu_reserved_bytes, open_fds, threads: slope < 1% of the mean per 100 steps (growth;
  open_fds counts both ends of every pooled HTTP connection to the in-process server, so it moves
  with the clients' concurrency, bounded by it);
- step time: the median step of the last 10% of the run within 10% of the median of steps
  5%-15% (steps 900-1000 against 50-150 of 1,000);
- background latency: the p99 of the last 10% within 20% of the p99 of steps 5%-15%;
- disk: the checkpoints never above what the retention allows, (keep_last + 1) adapters plus
  one optimizer state, from the sizes of the first checkpoint (the trajectory logs and history grow
  with the steps by design: their bytes per step are reported).

    python benchmarks/soak.py                                  # CPU: 200 small steps (2 groups x 4)
    python benchmarks/soak.py --device cuda --steps 1000       # GPU: the demo's 4 groups x 8
    python benchmarks/soak.py --device cuda --minutes 4        # GPU, bounded in time

On a CPU the step time is only as steady as the machine: other processes' load shows in it.
SIGTERM or Ctrl-C ends the run after the running step and prints the figures so far.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

GPU_SHAPES = {"steps": 1000, "groups_per_step": 4, "group_size": 8, "sample_every": 10, "rate": 4.0}
CPU_SHAPES = {"steps": 200, "groups_per_step": 2, "group_size": 4, "sample_every": 5, "rate": 0.5}
FLAT = ("rss_bytes", "gpu_reserved_bytes", "open_fds", "threads")  # growth < 1% of the mean per 100 steps
FLAT_LIMIT, STEP_TIME_LIMIT, LATENCY_LIMIT = 0.01, 0.10, 0.20


class BackgroundClient:
    """Sends one chat completion every `1 / rate` seconds from a thread of its own; `answers` holds
    (time it came back, seconds it took, ok) per request."""

    def __init__(self, base_url: str, api_key: str, model: str, rate: float, max_tokens: int = 16) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
        self.model, self.period_s, self.max_tokens = model, 1.0 / rate, max_tokens
        self.answers: list[tuple[float, float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-client", daemon=True)

    def _run(self) -> None:
        due, n = time.perf_counter(), 0
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                self.client.chat.completions.create(
                    model=self.model, max_tokens=self.max_tokens, temperature=0.7,
                    messages=[{"role": "user", "content": f"What is {n % 50}+{n % 7}? Answer with just the number."}])
                ok = True
            except Exception as exc:  # counted, and shown once at the end
                ok, self.error = False, repr(exc)
            end = time.perf_counter()
            self.answers.append((end, end - start, ok))
            n += 1
            due = max(due + self.period_s, end)  # late: at once, never a burst to catch up
            self._stop.wait(due - time.perf_counter())

    def __enter__(self) -> BackgroundClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # deleted meanwhile (retention)
                pass
    return total


def process_sample() -> dict[str, float | None]:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    cuda = torch.cuda.is_initialized()
    return {"rss_bytes": rss, "open_fds": len(os.listdir("/proc/self/fd")), "threads": threads,
            "gpu_allocated_bytes": torch.cuda.memory_allocated() if cuda else None,
            "gpu_reserved_bytes": torch.cuda.memory_reserved() if cuda else None}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def slope_per_100(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of value against step, times 100."""
    points = [(x, y) for x, y in points if y is not None]
    if len(points) < 3:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def summarize(samples: list[dict], step_times: list[float], answers: list[tuple[float, float, bool]],
              step_ends: list[float], *, keep_last: int, first_checkpoint: dict[str, int]) -> dict:
    """The JSON's figures and verdict from the samples, per-step times and background answers."""
    quantities = {}
    for key in ("rss_bytes", "gpu_allocated_bytes", "gpu_reserved_bytes", "open_fds", "threads", "run_dir_bytes",
                "checkpoints_bytes", "logs_bytes", "step_s", "bg_p50_s", "bg_p99_s"):
        points = [(s["step"], s[key]) for s in samples if s.get(key) is not None]
        if not points:
            quantities[key] = None
            continue
        slope = slope_per_100(points)
        mean = statistics.fmean(y for _, y in points)
        quantities[key] = {"first": points[0][1], "last": points[-1][1], "slope_per_100_steps": _round(slope),
                           "slope_fraction_per_100_steps": _round(slope / mean) if slope is not None and mean else None}
    n = len(step_times)
    early = (round(0.05 * n), max(round(0.15 * n), round(0.05 * n) + 1))  # steps 50-150 of 1,000
    late = (n - max(1, round(0.1 * n)), n)  # the last 100 of 1,000
    verdict: dict[str, dict] = {}
    for key in FLAT:
        q = quantities.get(key)
        if q is not None and q["slope_fraction_per_100_steps"] is not None:
            value = q["slope_fraction_per_100_steps"]  # growth: a count that falls is not a leak
            verdict[key] = {"slope_fraction_per_100_steps": value, "limit": FLAT_LIMIT, "ok": value < FLAT_LIMIT}
    if n >= 20:
        ref, last = statistics.median(step_times[early[0]:early[1]]), statistics.median(step_times[late[0]:late[1]])
        verdict["step_time_p50"] = {"early_s": _round(ref), "late_s": _round(last), "windows": [early, late],
                                    "ratio": _round(last / ref), "limit": 1 + STEP_TIME_LIMIT,
                                    "ok": last <= ref * (1 + STEP_TIME_LIMIT)}

        def window_p99(window: tuple[int, int]) -> float | None:
            start = step_ends[window[0] - 1] if window[0] > 0 else 0.0
            return percentile([s for t, s, ok in answers if ok and start < t <= step_ends[window[1] - 1]], 0.99)

        ref99, last99 = window_p99(early), window_p99(late)
        if ref99 and last99:
            verdict["background_p99"] = {"early_s": _round(ref99), "late_s": _round(last99), "ratio": _round(last99 / ref99),
                                         "limit": 1 + LATENCY_LIMIT, "ok": last99 <= ref99 * (1 + LATENCY_LIMIT)}
    if first_checkpoint:
        # + 64 KiB a checkpoint: its JSON files (trainer state, manifest) vary by a few bytes from step to step
        bound = (keep_last + 1) * (first_checkpoint["adapter_bytes"] + (64 << 10)) + first_checkpoint["training_state_bytes"]
        most = max(s["checkpoints_bytes"] for s in samples)
        verdict["checkpoints_disk"] = {"max_bytes": most, "bound_bytes": bound, "ok": most <= bound}
    return {"quantities": quantities, "verdict": verdict, "ok": all(v["ok"] for v in verdict.values())}


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.4g}")


def checkpoint_sizes(checkpoint: Path) -> dict[str, int]:
    """The bytes of a checkpoint's adapter (everything but the training state) and of its training state."""
    from tempering.storage.checkpoints import TRAINING_STATE_FILES

    state = sum((checkpoint / f).stat().st_size for f in TRAINING_STATE_FILES if (checkpoint / f).is_file())
    return {"adapter_bytes": dir_bytes(checkpoint) - state, "training_state_bytes": state}


async def soak(args: argparse.Namespace, root: Path) -> dict:
    import tempering as art
    from tempering.demo.task import AdditionTask
    from tempering.storage import ModelPaths

    task = AdditionTask()
    model = art.TrainableModel(name="soak", project="bench", base_model=args.base_model)
    paths = ModelPaths(root, model.project, model.name)
    config = art.TrainConfig(learning_rate=args.learning_rate, keep_last_checkpoints=args.keep_last)
    val_scenarios = task.scenarios(args.num_val, seed=10_000)
    held_out = set(val_scenarios)
    samples: list[dict] = []
    step_times: list[float] = []
    step_ends: list[float] = []
    first_checkpoint: dict[str, int] = {}
    deadline = time.perf_counter() + 60 * args.minutes if args.minutes else math.inf
    stop = asyncio.Event()  # SIGTERM / SIGINT: end after the running step, and print the figures so far
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with art.LocalBackend(path=root, device=args.device) as backend:
        await model.register(backend)
        # warm-up: the first step injects the adapter and compiles what it compiles, and a validation
        # opens as many pooled connections as the run's busiest moment will hold
        await _step(model, task, 0, args, config, held_out)
        if args.val_every:
            await _validate(model, task, val_scenarios)
        client = BackgroundClient(backend.base_url, backend._api_key, model.name, args.rate)
        with client:
            last_sample, done = time.perf_counter(), 0
            sample_start = 0
            for step in range(1, args.steps + 1):
                if time.perf_counter() > deadline or stop.is_set():
                    break
                start = time.perf_counter()
                await _step(model, task, step, args, config, held_out)
                if args.val_every and step % args.val_every == 0:  # the best-by-metric retention has a metric
                    await _validate(model, task, val_scenarios)
                end = time.perf_counter()
                step_times.append(end - start)
                step_ends.append(end)
                done = step
                if not first_checkpoint and paths.checkpoint(2).is_dir():
                    first_checkpoint = checkpoint_sizes(paths.checkpoint(2))
                if step % args.sample_every == 0:
                    window = [s for t, s, ok in client.answers if ok and t > last_sample]
                    sample = {"step": step, **process_sample(), "run_dir_bytes": dir_bytes(paths.model_dir),
                              "checkpoints_bytes": dir_bytes(paths.checkpoints_dir),
                              "step_s": statistics.fmean(step_times[sample_start:]),
                              "bg_p50_s": percentile(window, 0.5), "bg_p99_s": percentile(window, 0.99),
                              "bg_requests": len(window), "elapsed_s": round(end - last_sample, 2),
                              "step_times_s": [round(t, 3) for t in step_times[sample_start:]]}
                    sample["logs_bytes"] = sample["run_dir_bytes"] - sample["checkpoints_bytes"]
                    samples.append(sample)
                    sample_start, last_sample = len(step_times), end
                    print(json.dumps({k: _round(v) if isinstance(v, float) else v for k, v in sample.items()}),
                          file=sys.stderr, flush=True)
        failed = sum(1 for *_, ok in client.answers if not ok)
    record = {
        "benchmark": "soak",
        "device": args.device,
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else
        f"{platform.processor() or platform.machine()} x{os.cpu_count()} cores",
        "base_model": args.base_model,
        "steps": done,
        "shape": {"groups_per_step": args.groups_per_step, "group_size": args.group_size, "rate_per_s": args.rate,
                  "keep_last_checkpoints": args.keep_last, "val_every": args.val_every},
        "minutes": round(sum(step_times) / 60, 2),
        "bg_requests": len(client.answers),
        "bg_failed": failed,
        "bg_error": getattr(client, "error", None),
        "logs_bytes_per_step": _round((samples[-1]["logs_bytes"] - samples[0]["logs_bytes"])
                                      / max(1, samples[-1]["step"] - samples[0]["step"])) if len(samples) > 1 else None,
        **summarize(samples, step_times, client.answers, step_ends, keep_last=args.keep_last,
                    first_checkpoint=first_checkpoint),
        "torch": torch.__version__,
    }
    if failed:
        record["ok"] = False
    return record


async def _validate(model, task, scenarios: list) -> None:
    """One sample of each validation problem, logged as val/reward at the current step."""
    import tempering as art

    groups = await art.gather_trajectory_groups([art.TrajectoryGroup([task.rollout(model, s)]) for s in scenarios],
                                                pbar_desc=None)
    await model.log(groups, split="val")


async def _step(model, task, step: int, args: argparse.Namespace, config, held_out: set) -> None:
    import tempering as art

    scenarios = task.scenarios(args.groups_per_step, seed=step, exclude=held_out)
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(task.rollout(model, s) for _ in range(args.group_size)) for s in scenarios], pbar_desc=None)
    await model.train(groups, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="steps after the warm-up (GPU 1000, CPU 200)")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this many minutes of steps")
    parser.add_argument("--groups-per-step", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--sample-every", type=int, default=None, help="steps between samples (GPU 10, CPU 5)")
    parser.add_argument("--rate", type=float, default=None, help="background requests per second (GPU 4, CPU 0.5)")
    parser.add_argument("--keep-last", type=int, default=10, help="TrainConfig.keep_last_checkpoints")
    parser.add_argument("--val-every", type=int, default=20, help="log val/reward every this many steps (0: never)")
    parser.add_argument("--num-val", type=int, default=8, help="validation problems (one sample each)")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--base-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--path", type=Path, default=None, help="storage root (default: a temporary directory)")
    args = parser.parse_args()
    shapes = GPU_SHAPES if args.device == "cuda" else CPU_SHAPES
    for key, value in shapes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    with tempfile.TemporaryDirectory() as tmp:
        record = asyncio.run(soak(args, args.path or Path(tmp)))
    record["command"] = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
