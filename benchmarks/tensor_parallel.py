"""Tensor-parallel serving and training (modeling/tensor_parallel.py) of one model split over N GPUs.

Prints one JSON line. Each rank builds its shards of a random model directly on its device
(`parallel.shard_load.dummy_model`, as `EngineConfig(load_format="dummy")` does: the model is
created on the meta device and `shard_llama_` draws every shard where it lives, so a 72B model
never exists whole on one device or in host memory; the replicated embedding, LM head and norms
are drawn on each device), wraps them with a live rank-8 LoRA on every projection (A and
B non-zero), and starts its engine (rank 0 leads, the others follow) and its trainer on the same
shards. Then:

- rollouts: workload R (32 prompts x n=8, 128-token random prompts, 256 new tokens, EOS
  ignored, logprobs returned) with the live adapter, after a warm-up of the same shape and the
  capture of every decode CUDA graph; tokens/s (`--workloads R,1024x1` adds 1024 prompts x 1).
  With `--baseline`, rank 0 first runs the same workloads on the whole model alone (TP 1), and
  each workload's `vs_tp1` is the fixed batch's speed-up from splitting the model over N GPUs.
- a LoRA policy-gradient step (`Trainer.step`) on `--num-seqs` x `--seq-len` tokens (7/8 of them
  trained), after a warm-up step; tokens/s and MFU: 4 x matmul params x tokens (forward plus the
  backward to the inputs; recomputation not counted) over (989 TFLOP/s x N), H100 SXM dense bf16
  (an H200 has the same peak). `--no-recompute` keeps the activations instead of recomputing them.
- a checkpoint (`Trainer.save`: the shards gathered, the full PEFT adapter and optimizer state written
  once, by rank 0) and a resume: a step is taken, the checkpoint is loaded back into the same shards
  (each rank its slices, `Trainer.load_state` for the optimizer and RNG), the loaded state compared
  bit for bit with the saved one, and the same step taken again (twice, to tell the resume's error
  from the step's own run-to-run variation on the device).
- with `--profile`, one more step under torch.profiler: rank 0's kernel time by kind (NCCL,
  GEMMs, attention, the rest), its fifteen longest kernels and its idle time, to show where the MFU goes;
  and each rollout workload's decode steps over 2 s (rank 0's kernels per step, decode_scaling.py).
- peak memory allocated on every GPU (engine, KV cache and trainer together). At 72B and TP 4 a
  GPU holds ~40 GB of weights (35 GB of shards, 5 GB of replicated embedding and LM head), the KV
  cache (`--kv-fraction` of what is left) and a micro-batch's activations (`--micro-batch-tokens`).

`--check-greedy` instead compares greedy decoding at TP N with TP 1 on the same random weights
and adapter (the full model drawn from one seed on each device, then sharded; the reference on
rank 0 alone first): per prompt, whether the tokens are equal and where they first differ.

Shapes: `72b` (Qwen2.5-72B: hidden 8192, 80 layers, 64 heads, 8 KV heads, intermediate 29568,
vocab 152064, bf16, ~145 GB), `32b` (Qwen2.5-32B: hidden 5120, 64 layers, 40 heads, 8 KV heads,
intermediate 27648, ~66 GB: TP 2 on two 80 GB GPUs), `1.5b` (Qwen2.5-1.5B; TP 2 at most: 2 KV heads), `tiny` (a
2-layer Llama for checking the path on CPU processes through gloo).

It starts its own ranks 1..N-1 (torchrun's variables, NCCL on GPUs, gloo on CPUs), or runs under
`torchrun --nproc-per-node N benchmarks/tensor_parallel.py ...`.

    python benchmarks/tensor_parallel.py --device cuda --tp 4 --model 72b
    python benchmarks/tensor_parallel.py --device cuda --tp 2 --model 1.5b --workloads R,1024x1 --baseline
    python benchmarks/tensor_parallel.py --device cuda --tp 2 --model 1.5b --check-greedy [--dtype float32]
    python benchmarks/tensor_parallel.py --device cpu --tp 2 --model tiny [--check-greedy]
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import vllm_rollout
from tempering.engine import Engine, EngineConfig, SamplingParams
from tempering.engine.models import LlamaFamilyModel
from tempering.modeling.tensor_parallel import TensorParallel, shard_llama_
from tempering.parallel.shard_load import dummy_model
from tempering.service.policies import AdapterPolicy
from tempering.training import TokenizedSequence, Trainer
from tempering.training.trainer import ADAPTER_NAME
from tempering.types import LoRAConfig, TrainConfig

SHAPES = {
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=1024,
                 rms_norm_eps=1e-6),
}
WORKLOADS = {  # rollout.py's R and 1024x1 on GPUs (128-token prompts); small twins on CPUs
    "gpu": {"R": dict(num_prompts=32, n=8, max_new=256, prompt_len=128),
            "1024x1": dict(num_prompts=1024, n=1, max_new=256, prompt_len=128)},
    "cpu": {"R": dict(num_prompts=4, n=2, max_new=16, prompt_len=16),
            "1024x1": dict(num_prompts=8, n=1, max_new=16, prompt_len=16)},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
H100_BF16_FLOPS = 989e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_START = time.perf_counter()


def progress(what: str, device: torch.device) -> None:
    """One line on stderr: this rank, seconds since start, what just finished, GPU memory allocated
    (and reserved by PyTorch's caching allocator)."""
    memory = (f", {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated "
              f"({torch.cuda.memory_reserved(device) / 2**30:.1f} reserved)" if device.type == "cuda" else "")
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank} {time.perf_counter() - _START:7.1f} s] {what}{memory}", file=sys.stderr, flush=True)


def live_policy() -> AdapterPolicy:
    """The trainer's live adapter, as the service presents it to the engine (activating it is a no-op)."""
    return AdapterPolicy(None, ADAPTER_NAME, 1)


def hf_config(shape: str):
    from transformers import LlamaConfig, Qwen2Config

    return LlamaConfig(**SHAPES[shape]) if shape == "tiny" else Qwen2Config(**SHAPES[shape])


def build_sharded(shape: str, tp: TensorParallel | None, device: torch.device, dtype: torch.dtype):
    """A random model of `shape` holding this rank's shards, drawn on `device` without the whole model
    ever existing (`EngineConfig(load_format="dummy")`'s builder); with `tp` None, the whole model (for TP 1)."""
    return dummy_model(hf_config(shape), device, dtype, tp=tp, seed=1)


def build_full_then_shard(shape: str, tp: TensorParallel | None, device: torch.device, dtype: torch.dtype):
    """The whole random model drawn from one seed on `device` (the same on every rank), then sharded:
    for comparing TP N with TP 1 on equal weights (shapes that fit one device)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config(shape))
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False).eval()
    if tp is not None:
        shard_llama_(model, tp)
    return model


def full_adapter_state(shape: str, rank: int = 8) -> dict[str, torch.Tensor]:
    """A non-zero rank-8 LoRA on every projection, full shapes, by PEFT's saved names (drawn on the CPU
    from one seed)."""
    c = SHAPES[shape]
    H, I = c["hidden_size"], c["intermediate_size"]
    D = H // c["num_attention_heads"]
    shapes = {"q_proj": (H, c["num_attention_heads"] * D), "k_proj": (H, c["num_key_value_heads"] * D),
              "v_proj": (H, c["num_key_value_heads"] * D), "o_proj": (c["num_attention_heads"] * D, H),
              "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    g = torch.Generator().manual_seed(1)
    state = {}
    for layer in range(c["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            state[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    return state


def copy_adapter_(trainer: Trainer, tp: TensorParallel | None, state: dict[str, torch.Tensor]) -> None:
    """Put a full adapter (`state`, PEFT's saved names) into the trainer's LoRA tensors, this rank's slices."""
    from tempering.modeling.tensor_parallel import lora_shard_dim

    with torch.no_grad():
        for name, p in trainer.named_params:
            full = state[name.replace(".default", "")]
            p.copy_(tp.slice(full, lora_shard_dim(name)) if tp is not None else full)


def live_trainer(model, tp: TensorParallel | None, state: dict[str, torch.Tensor] | None = None) -> Trainer:
    """The trainer (rank-8 LoRA on every projection, alpha 16) on `model`'s shards, its A and B non-zero:
    `state` sliced for this rank, or drawn on the device (the same draws on every rank)."""
    trainer = Trainer.new(model, LoRAConfig(rank=8, alpha=16, target_modules=TARGETS), tp=tp)
    if state is not None:
        copy_adapter_(trainer, tp, state)
        return trainer
    g = torch.Generator(device=trainer.params[0].device).manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.named_params:
            scale = 0.01 if "lora_A" in name else 0.02
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * scale)
    return trainer


def engine_and_trainer(model, tp: TensorParallel | None, device: torch.device, args,
                       state: dict[str, torch.Tensor] | None = None) -> tuple[Engine, Trainer]:
    """The engine, then the trainer on the same shards (as the service makes them: the engine's fused
    weights, with their spare LoRA rows, are the ones the trainer then finds and shares)."""
    config = EngineConfig(tensor_parallel_size=tp.size if tp is not None else 1, max_num_seqs=256,
                          gpu_memory_fraction=args.kv_fraction, cpu_kv_cache_bytes=64 << 20)
    holder: dict = {}
    engine = Engine(LlamaFamilyModel(model, 4096, tp=tp), _NoTokenizer(), stop_token_ids=[], lock=threading.RLock(),
                    config=config, peft_model=lambda: holder["trainer"].peft_model if holder else None)
    holder["trainer"] = live_trainer(model, tp, state)
    return engine, holder["trainer"]


class _NoTokenizer:
    """A random model has no tokenizer: completions carry token ids only (their text is left empty)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def prompts_for(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(count)]


def time_rollouts(engine: Engine, prompts: list[list[int]], work: dict, rounds: int = 2) -> dict:
    """One workload with the live adapter: seconds and tokens/s of the best of `rounds` timed runs (every
    run's figure in `runs_tok_s`), after a full-length warm-up and the capture of every decode graph
    bucket; vLLM is timed the same way (`vllm_rollout.py`)."""
    policy = live_policy()
    graphs = engine.runner.graphs
    for size in graphs.buckets if graphs is not None else []:
        engine.submit(prompts[0][:16], SamplingParams(max_tokens=3, ignore_eos=True), n=size, policy=policy).result()
    params = SamplingParams(max_tokens=work["max_new"], temperature=1.0, ignore_eos=True)
    for f in [engine.submit(p, params, n=work["n"], policy=policy) for p in prompts]:
        f.result()
    runs = []
    for _ in range(rounds):
        engine.blocks.forget_cached()
        sync(engine.device)
        start = time.perf_counter()
        results = [f.result() for f in [engine.submit(p, params, n=work["n"], policy=policy) for p in prompts]]
        sync(engine.device)
        elapsed = time.perf_counter() - start
        num_tokens = sum(len(c.token_ids) for r in results for c in r)
        assert num_tokens == len(prompts) * work["n"] * work["max_new"]
        runs.append((elapsed, num_tokens / elapsed))
    elapsed, best = min(runs)
    return {"rollout_s": round(elapsed, 3), "rollout_tok_s": round(best, 1),
            "runs_tok_s": [round(tok_s, 1) for _, tok_s in runs]}


def baseline_rollouts(args, device: torch.device, dtype: torch.dtype, workloads: dict[str, dict]) -> dict:
    """The workloads on the whole model on this one device (TP 1), its memory freed afterwards."""
    vocab = SHAPES[args.model]["vocab_size"]
    model = build_sharded(args.model, None, device, dtype)
    engine, trainer = engine_and_trainer(model, None, device, args)
    try:
        return {name: time_rollouts(engine, prompts_for(work["num_prompts"], work["prompt_len"], vocab), work)
                for name, work in workloads.items()}
    finally:
        engine.close()
        del engine, trainer, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def train_sequences(num_seqs: int, seq_len: int, vocab: int) -> list[TokenizedSequence]:
    g = torch.Generator().manual_seed(2)
    prompt = seq_len // 8
    out = []
    for i in range(num_seqs):
        ids = torch.randint(100, vocab - 100, (seq_len,), generator=g).tolist()
        sampled = (-torch.rand(seq_len - prompt, generator=g) * 3).tolist()
        out.append(TokenizedSequence(ids, [False] * prompt + [True] * (seq_len - prompt),
                                     [float("nan")] * prompt + sampled, advantage=1.0 if i % 2 else -1.0,
                                     trajectory_index=i))
    return out


def train_config(args, learning_rate: float) -> TrainConfig:
    """The timed, profiled and resumed steps' config: the command line's micro-batch and recomputation."""
    return TrainConfig(learning_rate=learning_rate, micro_batch_tokens=args.micro_batch_tokens,
                       gradient_checkpointing=not args.no_recompute)


def time_train_step(trainer: Trainer, args, vocab: int, device: torch.device) -> dict:
    sequences = train_sequences(args.num_seqs, args.seq_len, vocab)
    config = train_config(args, learning_rate=1e-6)
    start = time.perf_counter()
    trainer.step(sequences, config)  # warm-up
    sync(device)
    first = time.perf_counter() - start
    progress(f"warm-up train step: {first:.1f} s", device)
    start = time.perf_counter()
    for step in range(args.steps):
        trainer.step(sequences, config)
        progress(f"train step {step + 1}/{args.steps}", device)
    sync(device)
    elapsed = (time.perf_counter() - start) / args.steps
    return {"train_first_step_s": round(first, 1), "train_step_s": round(elapsed, 3),
            "train_tok_s": round(args.num_seqs * args.seq_len / elapsed, 1)}


def sweep_train_steps(trainer: Trainer, tp: TensorParallel, args, vocab: int, device: torch.device, waits) -> list[dict]:
    """`--sweep`: the timed step (a warm-up, then `--steps`) under each variant, in one run on the
    same shards: micro-batch tokens, recomputation (`keep`: none), sequence parallelism (`nosp`:
    whole rows all-reduced after o and down), with the step's MFU and every rank's peak memory
    during the variant. Each result is printed as it comes (a variant that runs out of memory on
    one rank leaves the others waiting in a collective)."""
    results = []
    for spec in args.sweep:
        tokens, *flags = spec.split(":")
        variant = argparse.Namespace(**{**vars(args), "micro_batch_tokens": int(tokens), "no_recompute": "keep" in flags})
        trainer.decoder.sequence_parallel = "nosp" not in flags
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = {"variant": spec, **time_train_step(trainer, variant, vocab, device)}
        result["mfu"] = mfu(args, result["train_step_s"], tp.size)
        result["peak_gib_per_gpu"] = peak_gib_per_gpu(device, tp, waits)
        if tp.is_leader:
            print(f"sweep: {json.dumps(result)}", file=sys.stderr, flush=True)
        results.append(result)
    trainer.decoder.sequence_parallel = True
    return results


def train_and_resume(trainer: Trainer, tp: TensorParallel, args, vocab: int, device: torch.device, waits,
                     out: dict) -> None:
    """The sweep's variants, the timed step, its profile, and the checkpoint and resume, into `out`."""
    if args.sweep:
        out["sweep"] = sweep_train_steps(trainer, tp, args, vocab, device, waits)
    out.update(time_train_step(trainer, args, vocab, device))
    if tp.is_leader:  # kept if a later phase fails
        print(f"train: {json.dumps({k: v for k, v in out.items() if k.startswith('train_')})}", file=sys.stderr,
              flush=True)
    if args.profile:
        out.update(profile_train_step(trainer, args, vocab, device))  # rank 0's
    out.update(checkpoint_and_resume(trainer, tp, args, vocab, device, waits))
    progress("checkpoint and resume done", device)
    if device.type == "cuda":
        out["mfu"] = mfu(args, out["train_step_s"], tp.size)


def peak_gib_per_gpu(device: torch.device, tp: TensorParallel, waits) -> list[float | None]:
    """Every rank's peak allocated GPU memory since the last reset, GiB (None off CUDA); collective."""
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peaks = [None] * tp.size
    dist.all_gather_object(peaks, peak, group=waits)
    return [round(p, 2) if p is not None else None for p in peaks]


def mfu(args, step_s: float, num_gpus: int) -> float | None:
    """4 x matmul params x tokens over the GPUs' dense bf16 peak (None off CUDA)."""
    if args.device != "cuda":
        return None
    return round(4 * matmul_params(args.model) * args.num_seqs * args.seq_len / step_s / (H100_BF16_FLOPS * num_gpus), 4)


# the first kind whose marks a kernel's name holds (FlashAttention's names hold "cutlass" too: attention first)
KERNEL_KINDS = (("communication", ("nccl", "allreduce", "all_reduce")),
                ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "::mm", "::addmm", "::bmm")))


def profile_train_step(trainer: Trainer, args, vocab: int, device: torch.device) -> dict:
    """One more train step under torch.profiler: where this rank's step time goes. On a GPU the
    kernels' own time by kind (NCCL communication, GEMMs, attention, the rest: norms, rotary,
    LoRA, elementwise), the fifteen longest kernels, the time any kernel ran (`busy_ms`) and the
    GPU's idle time between the first kernel and the last (`idle_ms`); on a CPU the ops' own CPU time. The step runs
    slower under the profiler; the kernel times do not."""
    from torch.profiler import ProfilerActivity, profile

    sequences = train_sequences(args.num_seqs, args.seq_len, vocab)
    config = train_config(args, learning_rate=1e-6)
    cuda = device.type == "cuda"
    # on a GPU its kernels alone: a step's CPU ops are ~10^5 events, which the profiler takes minutes to process
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.step(sequences, config)
        sync(device)
    wall = time.perf_counter() - start
    totals: dict[str, float] = {}
    intervals: list[tuple[float, float]] = []
    if cuda:  # the kernels themselves (an op's own device time would count its kernels a second time)
        from torch.autograd import DeviceType
        for event in prof.events():
            if event.device_type == DeviceType.CUDA and not event.is_user_annotation:  # not nccl:all_reduce's range
                start_us, end_us = event.time_range.start, event.time_range.end
                totals[event.name] = totals.get(event.name, 0.0) + (end_us - start_us) / 1e3
                intervals.append((start_us, end_us))
    else:
        for event in prof.key_averages():
            if event.self_cpu_time_total > 0:
                totals[event.key] = totals.get(event.key, 0.0) + event.self_cpu_time_total / 1e3
    kinds = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, ms in totals.items():
        lowered = name.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")
        kinds[kind] += ms
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    out = {"step_s_profiled": round(wall, 3), "kernel_ms": round(sum(totals.values()), 1),
           "by_kind_ms": {k: round(v, 1) for k, v in kinds.items()},
           "top_ms": [[name[:90], round(ms, 1)] for name, ms in top]}
    if intervals:  # the time any kernel ran (streams overlapping counted once) and the GPU's idle time
        intervals.sort()
        busy, (lo, hi) = 0.0, intervals[0]
        for start_us, end_us in intervals[1:]:
            if start_us > hi:
                busy, lo = busy + hi - lo, start_us
            hi = max(hi, end_us)
        busy += hi - lo
        span = intervals[-1][1] - intervals[0][0]
        out.update(busy_ms=round(busy / 1e3, 1), idle_ms=round((span - busy) / 1e3, 1))
    return {"profile": out}


def checkpoint_and_resume(trainer: Trainer, tp: TensorParallel, args, vocab: int, device: torch.device,
                          waits) -> dict:
    """Save a checkpoint, take a step, resume from the checkpoint into the same shards and take the
    same step again, then once more: seconds to save and load, the checkpoint's size, whether the
    loaded state equals the saved one bit for bit on every rank, and how far the resumed step lands
    from the first one and from its own repetition (GPU kernels that add atomically, the loss's
    index_add among them, do not repeat a step bit for bit; CPUs do)."""
    from safetensors.torch import load_file

    directory = Path(args.checkpoint_dir)  # one host: every rank reads what rank 0 wrote
    if tp.is_leader:
        directory.mkdir(parents=True, exist_ok=True)
    sequences = train_sequences(args.num_seqs, args.seq_len, vocab)
    config = train_config(args, learning_rate=1e-4)
    def adapter() -> dict[str, torch.Tensor]:  # this rank's adapter slices
        return {n: p.detach().clone() for n, p in trainer.named_params}

    def snapshot() -> dict[str, torch.Tensor]:  # and its optimizer state
        state = adapter()
        for i, (_, p) in enumerate(trainer.named_params):
            for key, value in trainer.optimizer.state.get(p, {}).items():
                state[f"optimizer.{i}.{key}"] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
        return state

    def resume() -> None:
        copy_adapter_(trainer, tp, load_file(str(directory / "adapter_model.safetensors")))
        trainer.load_state(directory)

    def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)

    sync(device)
    start = time.perf_counter()
    trainer.save(directory if tp.is_leader else None, step=1)
    dist.barrier(group=waits)
    save_s = time.perf_counter() - start
    progress("checkpoint saved", device)
    saved = snapshot()
    trainer.step(sequences, config)
    first = adapter()
    start = time.perf_counter()
    resume()
    sync(device)
    load_s = time.perf_counter() - start
    progress("checkpoint loaded", device)
    restored = snapshot()
    exact_state = saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    trainer.step(sequences, config)
    resumed = adapter()
    resume()  # the same step once more from the same state: how far the step itself repeats on this device
    trainer.step(sequences, config)
    again = adapter()
    results = [None] * tp.size
    dist.all_gather_object(results, (exact_state, max_diff(first, saved),
                                     max_diff(resumed, first), max_diff(again, resumed)))
    size = sum(f.stat().st_size for f in directory.iterdir()) if tp.is_leader else 0
    return {"checkpoint_save_s": round(save_s, 2), "checkpoint_load_s": round(load_s, 2),
            "checkpoint_gib": round(size / 2**30, 3),
            # the adapter and optimizer state (moments, step counts) after loading equal the saved ones bit for bit
            "resume_restores_state": all(r[0] for r in results),
            "step_moves_adapter_max": float(f"{max(r[1] for r in results):.3g}"),
            # the step after resuming against the step taken before saving, and against itself repeated
            "resumed_step_max_diff": float(f"{max(r[2] for r in results):.3g}"),
            "repeated_step_max_diff": float(f"{max(r[3] for r in results):.3g}")}


def matmul_params(shape: str) -> int:
    c = SHAPES[shape]
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    D = H // c["num_attention_heads"]
    attention = H * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * D + c["num_attention_heads"] * D * H
    return L * (attention + 3 * H * I) + V * H  # the LM head's product, not the embedding's lookup


def greedy(engine: Engine, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    futures = [engine.submit(p, params, policy=live_policy()) for p in prompts]
    return [(c.token_ids, c.logprobs) for c in (f.result()[0] for f in futures)]


def check_greedy(args, tp: TensorParallel, device: torch.device, dtype: torch.dtype, waits) -> dict:
    """Greedy tokens at TP N against TP 1 on rank 0 (the same weights and adapter)."""
    vocab = SHAPES[args.model]["vocab_size"]
    work = WORKLOADS[device.type if device.type == "cpu" else "gpu"]["R"]
    prompts = prompts_for(8, work["prompt_len"], vocab, seed=3)
    max_new = 64 if device.type == "cuda" else 16
    state = full_adapter_state(args.model)
    reference = None
    if tp.is_leader:  # TP 1 first, alone on rank 0
        model = build_full_then_shard(args.model, None, device, dtype)
        engine, trainer = engine_and_trainer(model, None, device, args, state)
        reference = {"base": greedy(engine, prompts, max_new)}
        engine.close()
        del engine, trainer, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier(group=waits)
    model = build_full_then_shard(args.model, tp, device, dtype)
    checksums = [None] * tp.size
    dist.all_gather_object(checksums, float(model.model.embed_tokens.weight.float().sum()))
    engine, trainer = engine_and_trainer(model, tp, device, args, state)
    if not tp.is_leader:
        engine._thread.join()  # follows the leader's steps until its engine closes
        engine.close()  # frees its CUDA graphs (their all-reduces would block the teardown)
        return {}
    sharded = greedy(engine, prompts, max_new)
    engine.close()
    equal, first_diff, max_lp = [], [], 0.0
    for (ids, lps), (ref_ids, ref_lps) in zip(sharded, reference["base"]):
        equal.append(ids == ref_ids)
        first_diff.append(next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None))
        same = first_diff[-1] if first_diff[-1] is not None else len(ids)
        max_lp = max([max_lp, *(abs(a - b) for a, b in zip(lps[:same], ref_lps[:same]))])
    return {"check": "greedy", "same_weights_on_every_rank": len(set(checksums)) == 1,
            "greedy_equal": sum(equal) / len(equal), "first_difference": first_diff,
            "max_logprob_diff_before_difference": float(f"{max_lp:.3g}"), "new_tokens": max_new, "live_adapter": True}


def run(args) -> None:
    device_type = args.device
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args.memory_cap_gib:  # e.g. an H100's 79 GiB on an H200: allocations past it fail as they would there
            torch.cuda.set_per_process_memory_fraction(
                args.memory_cap_gib * 2**30 / torch.cuda.get_device_properties(device).total_memory, device)
    # the ranks share the machine's cores (at the default of all cores each, the parallel CPU kernels of
    # four ranks spun against each other: loading the 72B checkpoint's optimizer state took 70 s, not 1.5)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    if args.stack_dump_s:  # every thread's stack, every N seconds: where a slow or stuck rank is
        os.makedirs(args.stack_dump_dir, exist_ok=True)
        stacks = open(os.path.join(args.stack_dump_dir, f"stacks-rank{rank}.txt"), "w")  # noqa: SIM115 (kept open)
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True, file=stacks)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2))
    tp = TensorParallel(timeout_s=7200)
    # the ranks wait for each other on the host (gloo), never in a GPU kernel that would spin meanwhile
    waits = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=2))
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    workloads = {name: WORKLOADS["gpu" if device.type == "cuda" else "cpu"][name] for name in args.workloads}
    if args.check_greedy:
        out = check_greedy(args, tp, device, dtype, waits)
    else:
        out = {}
        if args.baseline and tp.is_leader:  # the same shape whole on this GPU alone, first
            out["tp1"] = baseline_rollouts(args, device, dtype, workloads)
            progress("TP 1 baseline done", device)
        dist.barrier(group=waits)
        vocab = SHAPES[args.model]["vocab_size"]
        start = time.perf_counter()
        model = build_sharded(args.model, tp, device, dtype)
        progress("model built", device)
        engine, trainer = engine_and_trainer(model, tp, device, args)
        sync(device)
        progress("engine and trainer built", device)
        out["build_s"] = round(time.perf_counter() - start, 1)
        if tp.is_leader:
            for name, work in workloads.items():
                prompts = prompts_for(work["num_prompts"], work["prompt_len"], vocab)
                out[name] = time_rollouts(engine, prompts, work)
                if "tp1" in out:  # the fixed batch's speed-up over one GPU
                    out[name]["vs_tp1"] = round(out[name]["rollout_tok_s"] / out["tp1"][name]["rollout_tok_s"], 3)
                vllm = getattr(args, "vllm_result", {}).get("workloads", {}).get(name, {}).get("lora_tok_per_s")
                if vllm:  # against vLLM + LoRA at the same tensor_parallel_size, measured first in this run
                    out[name]["vllm_lora_tok_s"] = vllm
                    out[name]["vs_vllm_lora"] = round(out[name]["rollout_tok_s"] / vllm, 2)
                if args.profile and device.type == "cuda":  # rank 0's kernels per decode step, over 2 s of it
                    from decode_scaling import profile_decoding

                    out[name]["decode_profile"] = profile_decoding(engine, prompts, work["n"], live_policy(),
                                                                   window_s=2.0)
            out["kv_cache_tokens"] = engine.blocks.capacity_tokens
            print(f"rollouts: {json.dumps(out)}", file=sys.stderr, flush=True)  # kept if the train step fails
        dist.barrier(group=waits)  # the followers' engines ran the rollouts; now every rank trains
        progress("rollouts done", device)
        # the engine stays up (as in training), idle: its followers wait for the leader's next step
        if not args.skip_train:
            train_and_resume(trainer, tp, args, vocab, device, waits, out)
        out["peak_gib_per_gpu"] = peak_gib_per_gpu(device, tp, waits)
        engine.close()
        if not tp.is_leader:
            engine._thread.join()
    if tp.is_leader:  # printed before the teardown, which cannot lose it
        print(json.dumps({
            "benchmark": "tensor_parallel", "model": args.model, "tp": args.tp, "device": device_type,
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "workload": None if args.check_greedy else
            {**workloads, "train_tokens": args.num_seqs * args.seq_len,
             "micro_batch_tokens": args.micro_batch_tokens, "kv_fraction": args.kv_fraction,
             "recompute": not args.no_recompute},
            **({"vllm": args.vllm_result} if getattr(args, "vllm_result", None) else {}), **out}), flush=True)
    dist.barrier(group=waits)
    progress("destroying the process groups", device)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tp", type=int, default=2,
                        help="tensor_parallel_size: processes (GPUs) the model is split over")
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: 72b on cuda, tiny on cpu")
    parser.add_argument("--check-greedy", action="store_true", help="compare greedy tokens at TP N with TP 1")
    parser.add_argument("--workloads", default="R", help="comma-separated rollout workloads: R, 1024x1 (none: no rollouts)")
    parser.add_argument("--baseline", action="store_true",
                        help="first time the workloads on the whole model on GPU 0 alone (TP 1; shapes that fit one "
                             "GPU): the fixed batch's speed-up over one GPU, measured in the same run")
    parser.add_argument("--num-seqs", type=int, default=None,
                        help="sequences per train step (default 16 on cuda, 4 on cpu)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default 1024 on cuda, 64 on cpu)")
    parser.add_argument("--steps", type=int, default=2, help="timed train steps")
    parser.add_argument("--skip-train", action="store_true", help="rollouts only: no train step, checkpoint or resume")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="EngineConfig.gpu_memory_fraction")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="TrainConfig.micro_batch_tokens")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on cuda, float32 on cpu; float32 on cuda: IEEE float32 throughout, "
                             "where greedy tokens at TP N should equal TP 1's (no bf16 rounding of near ties)")
    parser.add_argument("--no-recompute", action="store_true",
                        help="TrainConfig(gradient_checkpointing=False): keep each layer's activations instead of "
                             "recomputing them in the backward pass (more memory, ~1/3 fewer forward FLOPs)")
    parser.add_argument("--vllm", action="store_true",
                        help="first run the rollout workloads through vLLM + LoRA at tensor_parallel_size N (subprocess)")
    parser.add_argument("--vllm-path", default=None, help="directories first on the vLLM subprocess's PYTHONPATH")
    parser.add_argument("--vllm-timeout-s", type=float, default=1800, help="stop vLLM (and its workers) after this")
    parser.add_argument("--sweep", default="",
                        help="comma-separated train-step variants timed first, each TOKENS[:keep][:nosp] (micro-batch "
                             "tokens; keep: no recomputation; nosp: no sequence parallelism), e.g. "
                             "8192:nosp,8192,16384,4096:keep")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile one more (torch.profiler): rank 0's kernel time by kind "
                             "(NCCL, GEMM, attention, other), its fifteen longest kernels and its idle time")
    parser.add_argument("--memory-cap-gib", type=float, default=0,
                        help="cap each process's GPU allocations (0: none); 79 holds an H200 to an H100's memory")
    parser.add_argument("--checkpoint-dir", default="tp-checkpoint", help="where the checkpoint is written")
    parser.add_argument("--stack-dump-s", type=float, default=0,
                        help="write every thread's stack every N seconds (0: never) to --stack-dump-dir")
    parser.add_argument("--stack-dump-dir", default="tp-stacks", help="where each rank's stacks-rankR.txt goes")
    args = parser.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w and w != "none"]
    args.sweep = [v for v in args.sweep.split(",") if v]
    if unknown := set(args.workloads) - set(WORKLOADS["gpu"]):
        parser.error(f"unknown workloads {sorted(unknown)}: choose from {sorted(WORKLOADS['gpu'])}")
    gpu = args.device == "cuda"
    args.model = args.model or ("72b" if gpu else "tiny")
    args.num_seqs = args.num_seqs or (16 if gpu else 4)
    args.seq_len = args.seq_len or (1024 if gpu else 64)
    if (args.check_greedy or args.baseline) and args.model in ("72b", "32b"):
        parser.error("--check-greedy and --baseline put the whole model on one device: use --model 1.5b or tiny")
    if args.vllm and "RANK" not in os.environ:  # first, while vLLM can have the GPUs to itself
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, lora_dir = vllm_rollout.write_model_and_lora(hf_config(args.model), Path(tmp))
            args.vllm_result = vllm_rollout.launch(
                model_dir, lora_dir, {name: WORKLOADS["gpu"][name] for name in args.workloads}, args.vllm_path,
                tensor_parallel_size=args.tp, timeout_s=args.vllm_timeout_s)
        print(f"vllm: {json.dumps(args.vllm_result)}", file=sys.stderr, flush=True)
    procs = []
    if "RANK" not in os.environ:  # start ranks 1..N-1 as torchrun would, this process is rank 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = {"WORLD_SIZE": str(args.tp), "LOCAL_WORLD_SIZE": str(args.tp), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}
        for rank in range(1, args.tp):
            procs.append(subprocess.Popen([sys.executable, *sys.argv],
                                          env={**os.environ, **base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        os.environ.update({**base, "RANK": "0", "LOCAL_RANK": "0"})
    try:
        run(args)
    except BaseException:
        # now, not after ranks 1..N-1 exit: they may wait for this rank in a collective until their timeout
        traceback.print_exc()
        sys.stderr.flush()
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            if p.wait(timeout=600) != 0:
                print(f"rank process {p.args} exited with {p.returncode}", file=sys.stderr)


if __name__ == "__main__":
    main()
