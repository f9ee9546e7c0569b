"""LoRA policy-gradient step: tempering's trainer vs peft + a full-logits transformers forward.

Prints one JSON line. On GPU (`--device cuda`): a Qwen2.5-1.5B-shaped model with random bf16
weights (or `--model 7b`, Qwen2.5-7B-shaped), LoRA r=8 on all linear layers, `--num-seqs` ×
`--seq-len` tokens per step (default 16 × 1024), of which the last 7/8 are trained
(completion) tokens. The baseline in the same run is the common recipe: the PEFT model's
forward returns full logits, log-softmax over them in float32, the same PPO loss, backward,
AdamW; when the full batch does not fit, it runs on half the sequences (then a quarter...) and
the speedup compares tokens/s (`baseline_num_seqs` says). Ours is `Trainer.step` (tempering's
packed forward with fused LoRA and kernels, varlen attention, chunked logprobs from hidden states,
gradient checkpointing, each row's forward/backward replayed from a CUDA graph). Both are warmed
up (ours: its first step captures the graphs); each figure is the mean of `--steps` timed steps
after a device sync. Peak memory is reported as allocated and as reserved by the caching
allocator (which holds the CUDA graphs' memory pool); the memory ratio uses the reserved peaks.
`--also KEY=VALUE,...` times more configurations of ours in the same run (TrainConfig fields,
e.g. `--also gradient_checkpointing=0,micro_batch_tokens=4096 --also cuda_graphs=0`). MFU counts the model FLOPs of a LoRA step, 4 × params × tokens
(forward plus the backward pass to the inputs; recomputation not counted), against 989 TFLOP/s
(H100 SXM dense bf16). On CPU (default) the default model in fp32, 8 × 256 tokens.

    python benchmarks/train_step.py --device cuda
    python benchmarks/train_step.py --device cuda --also cuda_graphs=0 --also gradient_checkpointing=0,micro_batch_tokens=4096
    python benchmarks/train_step.py --device cuda --model 7b --num-seqs 1 --seq-len 8192 --skip-baseline

`--gpus N` measures the data-parallel step (training/data_parallel.py) against one GPU in the
same run: this process first times the step on GPU 0 alone, then starts ranks 1..N-1 (one
process per GPU, torch.distributed with NCCL; parallel/launch.py) and times the same step over
all N, each rank running its share of every mini-batch and the LoRA gradients all-reduced. It
prints one JSON line with both figures, their ratio, the peak memory of every GPU and whether the
ranks' adapters are bit-identical afterwards. `--model 32b` is Qwen2.5-32B-shaped (its base
weights replicated on every GPU: 61 GiB in bf16). No peft baseline with `--gpus`.

    python benchmarks/train_step.py --device cuda --gpus 2
    python benchmarks/train_step.py --device cuda --gpus 2 --model 32b --num-seqs 4 --seq-len 8192 --steps 2
    python benchmarks/train_step.py --device cpu --gpus 2        # the same path on 2 CPU processes (gloo)

Under torchrun (every rank started by it, also over several machines) `--gpus` is the world
size; the one-GPU figure is timed on rank 0 while the others wait, so `--skip-single` saves time:

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr NODE0 --master-port 29500 \
        benchmarks/train_step.py --device cuda --gpus 16 --num-seqs 128 --seq-len 1152 --skip-single
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import torch

from tempering.training import TokenizedSequence, Trainer, kernels
from tempering.types import LoRAConfig, TrainConfig

SHAPES = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args, device: torch.device):
    if device.type == "cpu":
        from transformers import AutoModelForCausalLM

        from tempering.service.base_model import default_model_dir

        return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[args.model], max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 32B model in fp32 would not fit the GPU
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model


def make_batch(args, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 100, (args.num_seqs, args.seq_len), generator=g)
    prompt = args.seq_len // 8
    sampled = -torch.rand(args.num_seqs, args.seq_len, generator=g) * 3 - 0.5
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(args.num_seqs)])
    return ids, prompt, sampled, advantages


def baseline_step(peft_model, optimizer, ids, prompt, sampled, advantages, device):
    """The common recipe: full logits from the PEFT model's forward, float32 log-softmax, PPO loss."""
    ids, sampled, advantages = ids.to(device), sampled.to(device), advantages.to(device)
    logits = peft_model(input_ids=ids).logits  # [B, T, V]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    logprobs, old = logprobs[:, prompt - 1:], sampled[:, prompt:]
    ratio = torch.exp(logprobs - old)
    a = advantages[:, None]
    loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_sequences(args, vocab: int) -> tuple[list[TokenizedSequence], int]:
    ids, prompt, sampled, advantages = make_batch(args, vocab)
    return [
        TokenizedSequence(ids[i].tolist(), [False] * prompt + [True] * (args.seq_len - prompt),
                          [float("nan")] * prompt + sampled[i, prompt:].tolist(), advantage=float(advantages[i]),
                          trajectory_index=i)
        for i in range(args.num_seqs)
    ], prompt


def timed_steps(trainer: Trainer, sequences, config: TrainConfig, steps: int, device: torch.device) -> dict:
    """Mean seconds of `steps` steps after a warm-up step, and this device's peak memory (GiB)."""
    trainer.step(sequences, config)  # warm-up: captures the CUDA graphs
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(sequences, config)
    sync(device)
    out = {"s": (time.perf_counter() - start) / steps}
    if device.type == "cuda":
        out.update(peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                   reserved_gib=round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
                   device_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1))
    return out


def data_parallel(args) -> None:
    """`--gpus N`: the step on GPU 0 alone, then data-parallel over N processes (see the docstring).

    Every process runs this function: rank 0 is the one the user started; ranks 1..N-1 are
    started by it with torchrun's variables and take the `is_worker` branch.
    """
    import torch.distributed as dist

    from tempering.parallel import Driver, join, serve
    from tempering.training.data_parallel import DataParallel

    is_worker = int(os.environ.get("RANK", "0")) > 0
    under_torchrun = not is_worker and "WORLD_SIZE" in os.environ  # else this process starts the others
    if under_torchrun and int(os.environ["WORLD_SIZE"]) != args.gpus:
        raise SystemExit(f"--gpus {args.gpus} but torchrun started {os.environ['WORLD_SIZE']} processes: pass --gpus "
                         f"{os.environ['WORLD_SIZE']}")
    device_type = torch.device(args.device).type
    if is_worker:
        info, conn, _store = join(device_type=device_type, timeout_s=1800, start_timeout_s=1800)
        device = info.device
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the processes of this machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", args.gpus))))
    model = build_model(args, device)
    sequences, prompt = make_sequences(args, model.config.vocab_size)
    config = TrainConfig(learning_rate=1e-5, micro_batch_tokens=args.micro_batch_tokens or TrainConfig().micro_batch_tokens,
                         gradient_checkpointing=not args.no_checkpointing, cuda_graphs=not args.no_cuda_graphs)
    tokens = args.num_seqs * args.seq_len
    lora = LoRAConfig(rank=8, alpha=16)
    single = None
    if not is_worker:
        trainer = Trainer.new(model, lora)
        if not args.skip_single:
            single = timed_steps(trainer, sequences, config, args.steps, device)
        peft_model = trainer.peft_model
        del trainer  # its CUDA graphs and optimizer state: not part of the N-GPU figure
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if under_torchrun:
            driver = Driver.from_env(device_type=device_type, timeout_s=1800, start_timeout_s=1800)
        else:
            driver = Driver.start(args.gpus, device_type=device_type, command=[sys.executable, *sys.argv], timeout_s=1800)
        trainer = Trainer(peft_model, lora, dp=DataParallel())  # the same LoRA tensors, now data-parallel
    else:
        trainer = Trainer.new(model, lora, dp=DataParallel())
    multi = timed_steps(trainer, sequences, config, args.steps, device)
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.params])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    multi["adapter_equals_rank_0"] = bool(torch.equal(flat, reference))
    multi["rank"] = dist.get_rank()
    per_rank: list = [None] * args.gpus
    dist.all_gather_object(per_rank, multi)
    if is_worker:
        serve(conn, None, rank=info.rank)  # nothing to serve: returns when rank 0 is done with us
        dist.destroy_process_group()
        return
    driver.close()
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lora_" not in n)
    if model.config.tie_word_embeddings:
        matmul_params += model.get_input_embeddings().weight.numel()
    gpu = device.type == "cuda"
    record = {
        "benchmark": "train_step_data_parallel",
        "device": args.device,
        "gpus": args.gpus,
        "machine": torch.cuda.get_device_name(device) if gpu else f"{platform.machine()} x{torch.get_num_threads()} threads",
        "model": f"Qwen2.5-{args.model}-shaped random bf16" if gpu else "SmolLM2-135M-Instruct fp32",
        "lora": "r=8 alpha=16, q/k/v/o/gate/up/down",
        "workload": f"{args.num_seqs} x {args.seq_len} tokens, {args.seq_len - prompt} trained per sequence",
        "single_tok_per_s": round(tokens / single["s"], 1) if single else None,
        "single_s": round(single["s"], 4) if single else None,
        "single_peak_gib": single.get("peak_gib") if single else None,
        "single_reserved_gib": single.get("reserved_gib") if single else None,
        "multi_tok_per_s": round(tokens / per_rank[0]["s"], 1),
        "multi_s": round(per_rank[0]["s"], 4),
        "ratio": round(single["s"] / per_rank[0]["s"], 3) if single else None,
        "multi_mfu": round(4 * matmul_params * tokens / per_rank[0]["s"] / (989e12 * args.gpus), 4) if gpu else None,
        "per_gpu": [{k: v for k, v in r.items() if k != "s"} for r in per_rank],
        "adapters_identical": all(r["adapter_equals_rank_0"] for r in per_rank),
        "micro_batch_tokens": config.micro_batch_tokens,
        "gradient_checkpointing": config.gradient_checkpointing,
        "cuda_graphs": config.cuda_graphs and gpu,
        "torch": torch.__version__,
    }
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep activations instead of recomputing")
    parser.add_argument("--also", action="append", default=[],
                        help="also time ours with these TrainConfig fields, e.g. gradient_checkpointing=0,micro_batch_tokens=4096")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run ours eagerly (no CUDA graphs)")
    parser.add_argument("--hf-forward", action="store_true",
                        help="ours with the transformers forward instead of tempering's decoder (for comparison)")
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of one step of ours to stderr")
    parser.add_argument("--kernels", default=None,
                        help="override training.kernels.CUDA_KERNELS, e.g. rms_norm=triton,rotary=triton")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel over this many GPUs, against one GPU")
    parser.add_argument("--skip-single", action="store_true", help="with --gpus: skip the one-GPU figure")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if args.kernels:
        kernels.CUDA_KERNELS.update(dict(item.split("=") for item in args.kernels.split(",")))
    args.num_seqs = args.num_seqs or (16 if gpu else 8)
    args.seq_len = args.seq_len or (1024 if gpu else 256)
    if args.gpus > 1:
        data_parallel(args)
        return
    micro = args.micro_batch_tokens or TrainConfig().micro_batch_tokens

    model = build_model(args, device)
    vocab = model.config.vocab_size
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if model.config.tie_word_embeddings:
        matmul_params += model.get_input_embeddings().weight.numel()  # the LM head is a matmul too
    trainer = Trainer.new(model, LoRAConfig(rank=8, alpha=16))
    if args.hf_forward:
        trainer.decoder = None
    ids, prompt, sampled, advantages = make_batch(args, vocab)
    sequences, _ = make_sequences(args, vocab)
    config = TrainConfig(learning_rate=1e-5, micro_batch_tokens=micro, gradient_checkpointing=not args.no_checkpointing,
                         cuda_graphs=not args.no_cuda_graphs)
    tokens = args.num_seqs * args.seq_len

    def timed(fn) -> tuple[float, float | None, float | None]:
        fn()  # warm-up
        sync(device)
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            fn()
        sync(device)
        elapsed = (time.perf_counter() - start) / args.steps
        if not gpu:
            return elapsed, None, None
        return elapsed, torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30

    base_s = base_peak = base_reserved = None
    base_seqs = args.num_seqs
    if not args.skip_baseline:  # first, so that nothing of ours is cached on the device
        trainer.model.train()
        while base_seqs >= 1:  # the full batch may not fit: halve it, and compare tokens/s
            try:
                base_s, base_peak, base_reserved = timed(lambda n=base_seqs: baseline_step(
                    trainer.peft_model, trainer.optimizer, ids[:n], prompt, sampled[:n], advantages[:n], device))
                break
            except torch.OutOfMemoryError:
                base_s = base_peak = base_reserved = None
                base_seqs //= 2
                trainer.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        trainer.optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.empty_cache()
    base_tokens = base_seqs * args.seq_len
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    ours_s, ours_peak, ours_reserved = timed(lambda: trainer.step(sequences, config))
    variants = []
    for spec in args.also:
        update = {k: type(getattr(config, k))(int(v) if v.isdigit() else v) for k, v in (kv.split("=") for kv in spec.split(","))}
        variant = config.model_copy(update=update)
        if gpu:
            torch.cuda.empty_cache()
        v_s, v_peak, v_reserved = timed(lambda v=variant: trainer.step(sequences, v))
        variants.append({"config": update, "tok_per_s": round(tokens / v_s, 1),
                         "peak_gib": round(v_peak, 2) if gpu else None,
                         "reserved_gib": round(v_reserved, 2) if gpu else None,
                         "speedup": round((tokens / v_s) / (base_tokens / base_s), 2) if base_s else None,
                         "memory_ratio": round(v_reserved / base_reserved, 3) if gpu and base_s else None,
                         "mfu": round(4 * matmul_params * tokens / v_s / 989e12, 4) if gpu else None})
    if args.profile and gpu:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            trainer.step(sequences, config)
            sync(device)
        import sys

        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45), file=sys.stderr)
    peak_flops = 989e12 if gpu else None
    bound = None
    if gpu:  # what the GPU allows (roofline.py), at its rates measured now
        from roofline import ModelShape, measure_device, train_bound

        hw = measure_device(device)
        bound = {**train_bound(ModelShape.from_config(model.config), hw, tokens=tokens, mean_context=args.seq_len / 2),
                 "hardware": hw}
        bound["fraction"] = round(bound["bound_s"] / ours_s, 3)
    record = {
        "benchmark": "train_step",
        "device": args.device,
        "machine": torch.cuda.get_device_name(device) if gpu else f"{platform.machine()} x{torch.get_num_threads()} threads",
        "model": f"Qwen2.5-{args.model}-shaped random bf16" if gpu else "SmolLM2-135M-Instruct fp32",
        "lora": "r=8 alpha=16, q/k/v/o/gate/up/down",
        "workload": f"{args.num_seqs} x {args.seq_len} tokens, {args.seq_len - prompt} trained per sequence",
        "ours_s": round(ours_s, 4),
        "ours_tok_per_s": round(tokens / ours_s, 1),
        "ours_peak_gib": round(ours_peak, 2) if gpu else None,
        "ours_reserved_gib": round(ours_reserved, 2) if gpu else None,
        "ours_mfu": round(4 * matmul_params * tokens / ours_s / peak_flops, 4) if gpu else None,
        "ours_graph_captures": trainer.rows.num_captures,
        "bound": bound,
        "forward": "transformers" if trainer.decoder is None else "tempering",
        "baseline_num_seqs": base_seqs if base_s else None,
        "baseline_s": round(base_s, 4) if base_s else None,
        "baseline_tok_per_s": round(base_tokens / base_s, 1) if base_s else None,
        "baseline_peak_gib": round(base_peak, 2) if gpu and base_s else None,
        "baseline_reserved_gib": round(base_reserved, 2) if gpu and base_s else None,
        "speedup": round((tokens / ours_s) / (base_tokens / base_s), 2) if base_s else None,
        "memory_ratio": round(ours_reserved / base_reserved, 3) if gpu and base_s else None,
        "micro_batch_tokens": micro,
        "gradient_checkpointing": config.gradient_checkpointing,
        "cuda_graphs": config.cuda_graphs and gpu,
        "variants": variants,
        "kernels": kernels.CUDA_KERNELS if gpu else "torch (CPU)",
        "torch": torch.__version__,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
