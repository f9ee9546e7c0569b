"""Whole RL iterations through the OpenAI endpoint: sequential gather-then-train vs pipelined.

An iteration is one training step on `--groups` groups of `--group-size` rollouts. Each rollout
is one chat completion of `--new-tokens` tokens (EOS ignored) on a `--prompt-tokens`-token
prompt, scored with a random reward (so every group has spread). Both variants run in one
process, on one backend and model, after a warm-up iteration:

- sequential: `gather_trajectory_groups` of all groups, then `model.train` (the engine idles
  while the trainer runs and the other way round);
- pipelined: `PipelineTrainer(max_staleness=1)`: the next batch's rollouts run while the trainer
  steps. Its first step also fills the pipeline, so the steady state is the mean of the later
  ones (both figures are printed).

Prints one JSON line: seconds per iteration, trained (completion) tokens per second of each
variant, their ratio, and on CUDA the fraction of wall-clock the GPU was busy, from NVML's
utilization counter (needs `pip install nvidia-ml-py`; null without it): over the whole pipelined
run, and over its steady state alone (`pipelined_gpu_busy_steady_per_gpu`: from the end of the
first step, which fills the pipeline, to the end of the last step but one, since the last step
trains while nothing is left to gather; 3 iterations or more).

    python benchmarks/rl_loop.py                  # CPU, the default model, small shapes
    python benchmarks/rl_loop.py --device cuda    # Qwen2.5-1.5B-shaped random bf16 model, 32 x 8,
                                                  # 128-token prompts, 1024 new tokens, 5 iterations
    python benchmarks/rl_loop.py --child-process  # the server in a child process (in_process=False)
    python benchmarks/rl_loop.py --device cuda --gpus 2 --dedicated
                                                  # GPU 0 trains, GPU 1 serves (dedicated mode) and
                                                  # computes part of each step when idle (work
                                                  # sharing; --no-work-sharing: GPU 0 alone); on CPU
                                                  # the same with two gloo processes

In dedicated mode the JSON also says how many of each step's micro-batches the serving GPUs
computed (`*_micro_batches_shared`, "shared/all"). In every layout `sequential_gather_requests_s`
gives the client's view of a sequential gather (from its start): when its last `create()` call
began, and when the first, the median and the last answer came back; with every rollout of the same
length, first to last answer is the burst of responses, and the first answer less the decoding
time is the burst of requests and the prefill.

On CUDA the model is built as in gpu_loop.py (random weights: speed does not depend on them) with
the default model's tokenizer and chat template (`--tokenizer-dir`, default: the converted
default model in the cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import torch

GPU_SHAPES = {"groups": 32, "group_size": 8, "prompt_tokens": 128, "new_tokens": 1024, "iterations": 5}
CPU_SHAPES = {"groups": 4, "group_size": 4, "prompt_tokens": 32, "new_tokens": 32, "iterations": 3}


class PeriodicSampler:
    """Reads `read()` every `period_s` on a thread while the `with` block runs; `samples` holds
    (time, value) pairs. `read()` raising at the start (e.g. no NVML) leaves `samples` empty."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> float:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start = time.perf_counter()
        try:
            self.read()
        except Exception:  # nothing to sample here: report null
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.perf_counter(), self.read()))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.end = time.perf_counter()


class BusySampler(PeriodicSampler):
    """The fraction of wall-clock each GPU of the machine ran a kernel: NVML's utilization (the
    percent of its last sample period with a kernel running), read every `period_s` and averaged
    (null off CUDA or without pynvml)."""

    def __init__(self, device: torch.device, period_s: float = 0.05) -> None:
        super().__init__(period_s)
        self.device = device

    def read(self) -> tuple[float, ...]:
        if self.device.type != "cuda":
            raise RuntimeError("not a CUDA device")
        return tuple(torch.cuda.utilization(i) for i in range(torch.cuda.device_count()))

    @property
    def fractions(self) -> list[float] | None:
        """Per GPU, in index order."""
        return self.fractions_between(-math.inf, math.inf)

    @property
    def fraction(self) -> float | None:
        """GPU 0's."""
        return self.fractions[0] if self.samples else None

    def fractions_between(self, start: float, end: float) -> list[float] | None:
        """Per GPU, from the samples taken in [start, end] (perf_counter seconds) alone."""
        window = [v for t, v in self.samples if start <= t <= end]
        if not window:
            return None
        return [round(sum(v[i] for v in window) / len(window) / 100, 3) for i in range(len(window[0]))]


class DecodeProgress(PeriodicSampler):
    """When the engine sampled tokens during a gather, from its decoded-token count read every
    `period_s`: the time to the first token, the time spent decoding, and the tail from the last
    sampled token to the end of the block (the response work of the last rollouts: serializing,
    parsing, scoring)."""

    def __init__(self, engine, period_s: float = 0.005) -> None:
        super().__init__(period_s)
        self.engine = engine

    def read(self) -> float:
        if self.engine is None:
            raise RuntimeError("the engine runs in another process")
        return self.engine.stats.num_decode_tokens

    def __enter__(self) -> Self:
        self.preemptions = self.engine.stats.num_preemptions if self.engine is not None else 0
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.engine is not None:
            self.preemptions = self.engine.stats.num_preemptions - self.preemptions

    def summary(self) -> dict:
        counts = [c for _, c in self.samples]
        if not counts or counts[-1] == counts[0]:
            return {}
        first = next(t for t, c in self.samples if c > counts[0])
        last = next(t for t, c in self.samples if c == counts[-1])
        return {"first_token_s": round(first - self.start, 3), "decoding_s": round(last - first, 3),
                "tail_s": round(self.end - last, 3), "preemptions": self.preemptions}


def make_prompts(tokenizer, renderer, count: int, num_tokens: int, seed: int = 0) -> list[str]:
    """`count` different user messages whose rendered chat prompt is `num_tokens` tokens long."""
    rng = random.Random(seed)
    words = [w for w in (tokenizer.decode([i]).strip() for i in range(1000, 6000)) if w.isalpha()]
    shortest = len(renderer.render_prompt([{"role": "user", "content": words[0]}]))
    if shortest > num_tokens:
        raise SystemExit(f"--prompt-tokens {num_tokens} is shorter than the chat template's own prompt "
                         f"({shortest} tokens)")
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(num_tokens))
        while len(renderer.render_prompt([{"role": "user", "content": text}])) > num_tokens:
            text = text.rsplit(" ", 1)[0]
        while len(renderer.render_prompt([{"role": "user", "content": text}])) < num_tokens:
            text += " " + rng.choice(words)
            if len(renderer.render_prompt([{"role": "user", "content": text}])) > num_tokens:
                text = text.rsplit(" ", 1)[0] + " a"
                break
        prompts.append(text)
    return prompts


async def run(base_model: str, root: Path, device: str, shapes: dict, in_process: bool = True, gpus: int = 1,
              dedicated: bool = False, batch_invariant: bool = False, work_sharing: bool = True) -> dict:
    import tempering as art

    groups, group_size, iterations = shapes["groups"], shapes["group_size"], shapes["iterations"]
    new_tokens = shapes["new_tokens"]
    hw = None
    if device == "cuda":  # what the GPU allows (roofline.py): its rates, measured before the model takes the memory
        from roofline import measure_device

        hw = measure_device(torch.device("cuda", 0))
    model = art.TrainableModel(name="rl-loop", project="bench", base_model=base_model)
    backend = art.LocalBackend(path=root, device=device, in_process=in_process, gpus=gpus, dedicated=dedicated,
                               engine_config={"batch_invariant": True} if batch_invariant else None)
    await model.register(backend)
    if in_process:
        service = backend._registry.get(model.name)
        # several processes: the engines that decode are not all (dedicated: not at all) this one's
        tokenizer, renderer, engine = service.tokenizer, service.renderer, service.engine if gpus == 1 else None
    else:  # the server is in a child process: the prompts are made from the model's own tokenizer here
        from transformers import AutoTokenizer

        from tempering.chat import ChatRenderer
        from tempering.service.base_model import resolve_base_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(base_model).model_ref)
        renderer, engine = ChatRenderer(tokenizer), None
    prompts = iter(make_prompts(tokenizer, renderer, groups * (3 * iterations + 4), shapes["prompt_tokens"]))
    config = art.TrainConfig(learning_rate=1e-5, work_sharing=work_sharing)  # LoRA r8 (the model's default)
    rewards = random.Random(0)
    client = model.openai_client()
    request_times: list[tuple[float, float]] = []  # (sent, answered) of each request, this process's clock

    async def rollout(model, prompt, _config=None):
        traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
        sent = time.perf_counter()
        completion = await client.chat.completions.create(
            model=model.name, messages=traj.messages(), max_tokens=new_tokens, temperature=1.0,
            extra_body={"ignore_eos": True})
        request_times.append((sent, time.perf_counter()))
        traj.messages_and_choices.append(completion.choices[0])
        traj.reward = rewards.random()
        return traj

    async def sequential_iteration() -> dict:
        start = time.perf_counter()
        scenarios = [next(prompts) for _ in range(groups)]
        request_times.clear()
        with DecodeProgress(engine) as progress:
            batch = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, p) for _ in range(group_size)) for p in scenarios), pbar_desc=None)
        gathered = time.perf_counter()
        last_call, answered = max(t for t, _ in request_times), sorted(t for _, t in request_times)
        result = await model.train(batch, config=config)
        end = time.perf_counter()
        return {"s": end - start, "gather_s": gathered - start, "train_s": end - gathered,
                "trained_tokens": result.metrics["data/step_completion_tokens"], **progress.summary(),
                # the client's view, in any layout: when the last create() call began, and when the
                # first, the median and the last answer came back (all from the gather's start)
                "last_call_s": last_call - start, "first_answer_s": answered[0] - start,
                "median_answer_s": statistics.median(answered) - start, "last_answer_s": answered[-1] - start}

    await sequential_iteration()  # warm-up: first requests, the trainer's first step (and CUDA graph captures)

    gpu = torch.device(device, 0) if device == "cuda" else torch.device(device)
    with BusySampler(gpu) as busy:
        sequential = [await sequential_iteration() for _ in range(iterations)]
    sequential_busy, sequential_busy_all = busy.fraction, busy.fractions

    first_step = await model.get_step()
    pipeline = art.PipelineTrainer(model, backend, rollout, prompts, group_size=group_size, groups_per_step=groups,
                                   max_staleness=1, max_steps=iterations + 1, train_config=config, pbar=False)
    with BusySampler(gpu) as busy:
        piped_start = time.perf_counter()
        piped = await pipeline.train()
    # the steady state: from the end of the first step (which fills the pipeline) to the end of the
    # last step but one (the last trains while nothing is left to gather)
    step_ends = [piped_start + sum(piped.step_wall_s[:i + 1]) for i in range(len(piped.step_wall_s))]
    steady_busy = busy.fractions_between(step_ends[0], step_ends[-2]) if len(step_ends) >= 3 else None
    rows = {r["step"]: r for r in await backend._read_history(model) if "train/reward" in r}
    piped_tokens = [rows[first_step + i]["data/step_completion_tokens"] for i in range(iterations + 1)]
    ages = [rows[first_step + i].get("offpolicy/policy_age_mean", 0.0) for i in range(iterations + 1)]
    piped_train = [rows[first_step + i].get("time/step_trainer_s", 0.0) for i in range(1, iterations + 1)]
    piped_rescore = [rows[first_step + i].get("time/step_rescore_s", 0.0) for i in range(1, iterations + 1)]
    # the train call's host work beside the trainer's step, per steady step (ModelService.train's phases)
    phases = ("prepare", "checkpoint", "send_adapter", "write_trajectories", "wall")
    piped_phases = {name: round(statistics.mean(rows[first_step + i].get(f"time/step_{name}_s", 0.0)
                                                 for i in range(1, iterations + 1)), 3) for name in phases}

    def shared(row: dict) -> str | None:  # dedicated mode: micro-batches the serving GPUs computed, of all
        if "data/step_micro_batches" not in row:
            return None
        return f"{row['data/step_micro_batches_shared']:.0f}/{row['data/step_micro_batches']:.0f}"

    sequential_shared = [shared(rows[first_step - iterations + i]) for i in range(iterations)]
    piped_shared = [shared(rows[first_step + i]) for i in range(iterations + 1)]
    await backend.close()

    bound = None
    if hw is not None:  # the iteration's gather at its decode bound, then its step at the GEMM rate
        from transformers import AutoConfig

        from roofline import ModelShape, decode_bound, train_bound

        shape = ModelShape.from_config(AutoConfig.from_pretrained(base_model))
        rows, context = groups * group_size, shapes["prompt_tokens"] + new_tokens
        gather_b = decode_bound(shape, hw, rows=rows, prompt=shapes["prompt_tokens"], new=new_tokens, prompts=groups)
        train_b = train_bound(shape, hw, tokens=rows * context, mean_context=context / 2)
        bound = {"hardware": hw, "bound_s": round(gather_b["bound_s"] + train_b["bound_s"], 3),
                 "gather_bound_s": gather_b["bound_s"], "train_bound_s": train_b["bound_s"]}
    seq_s = statistics.mean(it["s"] for it in sequential)
    seq_tps = sum(it["trained_tokens"] for it in sequential) / sum(it["s"] for it in sequential)
    steady = piped.step_wall_s[1:]
    pipe_s = statistics.mean(steady)
    pipe_tps = sum(piped_tokens[1:]) / sum(steady)
    return {
        "benchmark": "rl_loop",
        "device": device,
        "server": "this process" if in_process else "a child process (LocalBackend(in_process=False))",
        "gpus": gpus, "layout": ("dedicated (GPU 0 trains, the others serve" + (" and share the step when idle)"
                                                                             if work_sharing else ")")) if dedicated else
        ("shared (every GPU serves and trains)" if gpus > 1 else "one device"),
        "machine": torch.cuda.get_device_name(gpu) if gpu.type == "cuda" else "cpu",
        "model": base_model if device == "cpu" else "Qwen2.5-1.5B-shaped random bf16 (SmolLM2 tokenizer)",
        **{k: v for k, v in shapes.items()},
        "sequential_s_per_iteration": round(seq_s, 3),
        "sequential_gather_s": round(statistics.mean(it["gather_s"] for it in sequential), 3),
        "sequential_train_s": round(statistics.mean(it["train_s"] for it in sequential), 3),
        "sequential_gather_phases": {k: round(statistics.mean(it.get(k, 0) for it in sequential), 3)
                                     for k in ("first_token_s", "decoding_s", "tail_s", "preemptions")}
                                    if engine is not None else None,  # measured in the engine's process only
        "sequential_gather_requests_s": {k: round(statistics.mean(it[k] for it in sequential), 3) for k in
                                         ("last_call_s", "first_answer_s", "median_answer_s", "last_answer_s")},
        "sequential_trained_tokens_per_s": round(seq_tps, 1),
        "sequential_gpu_busy_fraction": sequential_busy,  # GPU 0's
        "sequential_gpu_busy_fraction_per_gpu": sequential_busy_all,
        "pipelined_s_per_iteration": round(pipe_s, 3),
        "pipelined_first_iteration_s": round(piped.step_wall_s[0], 3),
        "pipelined_trained_tokens_per_s": round(pipe_tps, 1),
        "pipelined_gpu_busy_fraction": busy.fraction,
        "pipelined_gpu_busy_fraction_per_gpu": busy.fractions,
        "pipelined_gpu_busy_steady_per_gpu": steady_busy,
        "pipelined_step_wall_s": [round(x, 3) for x in piped.step_wall_s],
        "pipelined_policy_age_mean": round(statistics.mean(ages[1:]), 3),
        "pipelined_train_s": round(statistics.mean(piped_train), 3),  # the trainer's time per step
        "pipelined_rescore_s": round(statistics.mean(piped_rescore), 3),  # of which exact mode's rescoring
        "pipelined_train_call_s": piped_phases,  # the train call: its wall time and its phases beside the step
        "pipelined_stale_groups_dropped": piped.num_stale_groups_dropped,
        "sequential_micro_batches_shared": sequential_shared if dedicated else None,
        "pipelined_micro_batches_shared": piped_shared if dedicated else None,
        "ratio_s_per_iteration": round(pipe_s / seq_s, 3),
        "bound": bound and {**bound, "pipelined_fraction": round(bound["bound_s"] / pipe_s, 3),
                            "sequential_fraction": round(bound["bound_s"] / seq_s, 3)},
        "ratio_trained_tokens_per_s": round(pipe_tps / seq_tps, 3),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="CUDA: tokenizer of the random model")
    for name in GPU_SHAPES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval (seconds) for this process: how long a thread holding the GIL "
                             "keeps it while the engine's thread waits (Python's default 0.005)")
    parser.add_argument("--child-process", action="store_true",
                        help="serve and train in a child process (LocalBackend(in_process=False)); the gather's "
                             "phases are then not measured")
    parser.add_argument("--gpus", type=int, default=1, help="processes (GPUs; on CPU, gloo processes) to run on")
    parser.add_argument("--dedicated", action="store_true",
                        help="with --gpus N: GPU 0 trains and the others serve (LocalBackend(dedicated=True))")
    parser.add_argument("--no-work-sharing", action="store_true",
                        help="with --dedicated: every step on GPU 0 alone (TrainConfig(work_sharing=False))")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="exact on-policy: the engine's batch-invariant mode (EngineConfig.batch_invariant)")
    args = parser.parse_args()
    if args.dedicated and args.gpus < 2:
        parser.error("--dedicated needs --gpus 2 or more")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    shapes = dict(GPU_SHAPES if args.device == "cuda" else CPU_SHAPES)
    shapes.update({k: getattr(args, k) for k in shapes if getattr(args, k) is not None})
    with tempfile.TemporaryDirectory() as tmp:
        if args.device == "cuda":
            from tempering.service.base_model import default_model_dir

            sys.path.insert(0, str(Path(__file__).parent))
            from gpu_loop import build_model_dir

            base_model = str(build_model_dir(args.tokenizer_dir or default_model_dir(), Path(tmp) / "model"))
        else:
            base_model = "SmolLM2-135M-Instruct"
        record = asyncio.run(run(base_model, Path(tmp) / "runs", args.device, shapes, in_process=not args.child_process,
                                 gpus=args.gpus, dedicated=args.dedicated, batch_invariant=args.batch_invariant,
                                 work_sharing=not args.no_work_sharing))
    print(file=sys.stderr, flush=True)  # end the progress bars' line: with 2>&1 the JSON then starts a line of its own
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
