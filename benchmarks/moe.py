"""Qwen3-MoE on a GPU: rollouts with the live adapter, a LoRA train step, routing replay's cost (one JSON line).

The model is Qwen3-30B-A3B-shaped (hidden 2048, 48 layers, 32 heads, 4 KV heads, head dim 128,
128 experts of intermediate 768, 8 active, vocab 151936) with random bf16 weights (speed does not
depend on their values); LoRA r=8, alpha=16 on ART's target modules: q/k/v/o_proj, and every
expert's gate/up/down through PEFT's target_parameters (gate and up fused at rank 16, down rank 8,
each expert its own A and B), A and B non-zero, the trainer's tensors, as every rollout after step 0.

- rollout: workload R (32 prompts × n=8, 128-token random prompts, 256 new tokens, temperature 1,
  EOS ignored, the logprob of every sampled token returned) with the live adapter, once as the RL
  loop runs it (each sample also returns its routed experts, for routing replay) and once without
  them; warmed up with the same prompts and shapes, every decode CUDA graph captured first, the
  prefix cache emptied before timing (rollout.py's helpers). `--vllm` first runs R through vLLM +
  a rank-8 LoRA on the same layers (per expert gate/up/down, the layout ART exports for vLLM) in a
  subprocess (vllm_rollout.py), R timed twice per vLLM instance (`--vllm-launches N`: N instances
  one after the other), and the ratio to vLLM's best run is reported.
- train: `Trainer.step` on `--num-seqs` × `--seq-len` tokens (the last 7/8 of each trained), with
  routed experts to replay (random ids, as a rollout would send them) and without; tokens/s and
  peak memory (allocated and reserved) after a warm-up step (which captures the CUDA graphs).
- replay: routing replay's effect on the engine/trainer logprob mismatch. The engine samples
  with the live adapter (8 prompts × n=4) and returns each token's experts; the trainer computes
  the same tokens' logprobs with those experts replayed and with its own routing; reported: mean,
  p99 and max |trainer - engine| of each, and the fraction of tokens off by more than the replayed
  maximum without replay. With `--tiny` the routers are scaled by 0.3 (near-tied experts) and the
  experts by 8 (so that a flip shows); in bf16 (`--dtype bfloat16`) rounding differences between
  the engine's and the trainer's kernels then flip some tokens' experts.
- `--baseline-grouped-delta` (CUDA): then R again with the expert LoRA as two grouped GEMMs per
  projection (`modeling.experts._add_delta_`, the trainer's path) instead of the engine's Triton
  kernels (engine/layers/triton_moe_lora.py), and the speedup of the kernels.
- `--profile` (CUDA): after the timed rollouts, a window of R's steady decoding under torch.profiler
  (decode_scaling.py's): the fraction of the wall time the GPU ran kernels, the kernel time and
  count per decode step, and the longest kernels.
- `--tiny`: a 2-layer, 64-wide shape of 16 experts, 4 active, to check the script (CPU: `--device cpu`).

    python benchmarks/moe.py --device cuda                          # rollout + train (an H200: 139 GiB)
    python benchmarks/moe.py --device cuda --parts rollout --vllm   # rollouts against vLLM (vLLM installed)
    python benchmarks/moe.py --device cuda --parts rollout --profile  # where a decode step's time goes
    python benchmarks/moe.py --device cuda --parts rollout --batch-invariant  # exact on-policy mode against the default
    python benchmarks/moe.py --device cuda --parts train --num-seqs 8
    python benchmarks/moe.py --device cpu --tiny
    python benchmarks/moe.py --device cpu --tiny --dtype bfloat16 --parts replay    # the CPU measurement
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import vllm_rollout
from rollout import capture_all_graphs, machine, make_prompts, sync
from roofline import ModelShape, decode_bound, measure_device, train_bound
from tempering.engine import Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.training import TokenizedSequence, Trainer
from tempering.types import LoRAConfig, TrainConfig

QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, moe_intermediate_size=768, intermediate_size=6144, num_experts_per_tok=8,
                     norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, architectures=["Qwen3MoeForCausalLM"])
TINY = dict(QWEN3_30B_A3B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=16, moe_intermediate_size=32, intermediate_size=96, num_experts_per_tok=4, vocab_size=512)
R = dict(num_prompts=32, n=8, max_new=256)
TINY_R = dict(num_prompts=4, n=2, max_new=16)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, *, near_tied: bool = False):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
    finally:
        torch.set_default_dtype(default)
    if near_tied:  # see the module docstring (replay)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(0.3)
                layer.mlp.experts.gate_up_proj.mul_(8.0)
                layer.mlp.experts.down_proj.mul_(8.0)
    return model.eval()


def live_adapter(model) -> Trainer:
    """The trainer's LoRA with random non-zero A and B (drawn on the model's device)."""
    trainer = Trainer.new(model, LoRAConfig(rank=8, alpha=16, target_modules=TARGETS))
    g = torch.Generator(device=trainer.params[0].device).manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device) * (0.01 if "lora_A" in name else 0.02))
    return trainer


def time_rollouts(engine: Engine, prompts: list[list[int]], work: dict, policy, routed: bool) -> float:
    """Tokens/s of the workload (after a warm-up with the same prompts, the graphs captured first)."""
    capture_all_graphs(engine, prompts[0][:16], policy)
    warm = SamplingParams(max_tokens=work["max_new"], temperature=1.0, ignore_eos=True, return_routed_experts=routed)
    for f in [engine.submit(p, warm, n=work["n"], policy=policy) for p in prompts]:
        f.result()
    engine.blocks.forget_cached()
    params = SamplingParams(max_tokens=work["max_new"], temperature=1.0, ignore_eos=True, return_routed_experts=routed)
    sync(engine.device)
    start = time.perf_counter()
    results = [f.result() for f in [engine.submit(p, params, n=work["n"], policy=policy) for p in prompts]]
    sync(engine.device)
    elapsed = time.perf_counter() - start
    for r in results:
        for c in r:
            assert len(c.token_ids) == work["max_new"] and (c.routed_experts is not None) == routed
    return len(prompts) * work["n"] * work["max_new"] / elapsed


def rollout_part(args, model, trainer: Trainer, device: torch.device, record: dict) -> None:
    from tempering.service.policies import AdapterPolicy

    class _Tok:  # random weights: no tokenizer; EOS ignored anyway
        def decode(self, ids, skip_special_tokens=True):
            return ""

    work = TINY_R if args.tiny else R

    def make_engine(grouped_delta: bool = False, batch_invariant: bool = False) -> Engine:
        decoder = engine_model_for(model, 4096, batch_invariant=batch_invariant)
        if grouped_delta:  # the expert LoRA as two grouped GEMMs (the trainer's path), not the engine's kernels
            decoder.add_expert_delta = None
        return Engine(decoder, _Tok(), stop_token_ids=[151645], lock=threading.RLock(),
                      config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, cpu_kv_cache_bytes=1 << 28,
                                          batch_invariant=batch_invariant),
                      max_seq_len=4096, peft_model=lambda: trainer.peft_model)

    engine = make_engine()
    policy = AdapterPolicy(trainer.peft_model, "default", 1)
    prompts = make_prompts(work["num_prompts"], None, model.config.vocab_size, seed=1)
    runs: dict[str, list[float]] = {"routed": [], "plain": []}
    try:
        for r in range(args.rounds):  # alternating, as rollout.py does: a GPU's clock drifts as it heats
            for routed in ((True, False) if r % 2 == 0 else (False, True)):
                runs["routed" if routed else "plain"].append(time_rollouts(engine, prompts, work, policy, routed))
        record["rollout"] = {
            "workload": work, "kv_blocks": engine.runner.num_blocks,
            "lora_routed_experts_tok_per_s": round(float(np.mean(runs["routed"])), 1),
            "lora_tok_per_s": round(float(np.mean(runs["plain"])), 1),
            "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
            "decode_graphs": sum(c is not None for c in engine.runner.graphs.graphs.values()) if engine.runner.graphs else 0,
        }
        record["rollout"]["routing_cost"] = round(1 - record["rollout"]["lora_routed_experts_tok_per_s"]
                                                  / record["rollout"]["lora_tok_per_s"], 3)
        # where a decode step's time goes (decode_scaling.py); a 2 s window: ~50 of R's ~40 ms steps, so
        # that the steps cut at its edges weigh little
        if args.profile and device.type == "cuda":
            from decode_scaling import profile_decoding

            record["rollout"]["decode_profile"] = profile_decoding(engine, prompts, work["n"], policy, window_s=2.0)
    finally:
        engine.close()
        del engine  # and its KV cache: a later train step's peak memory is the trainer's alone
        gc.collect()  # (the engine's reference cycles)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda" and args.batch_invariant:  # the same R in exact on-policy mode
        engine = make_engine(batch_invariant=True)
        try:
            exact = [time_rollouts(engine, prompts, work, policy, routed=True) for _ in range(args.rounds)]
        finally:
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        record["rollout"]["batch_invariant_routed_tok_per_s"] = round(float(np.mean(exact)), 1)
        record["rollout"]["batch_invariant_runs"] = [round(x, 1) for x in exact]
        record["rollout"]["batch_invariant_vs_default"] = round(
            float(np.mean(exact)) / record["rollout"]["lora_routed_experts_tok_per_s"], 3)
    if device.type == "cuda" and args.baseline_grouped_delta:  # the same R, the expert LoRA as grouped GEMMs
        engine = make_engine(grouped_delta=True)
        try:
            grouped = time_rollouts(engine, prompts, work, policy, routed=False)
        finally:
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        record["rollout"]["lora_tok_per_s_grouped_gemm_delta"] = round(grouped, 1)
        record["rollout"]["expert_lora_kernels_speedup"] = round(record["rollout"]["lora_tok_per_s"] / grouped, 3)


def train_part(args, model, trainer: Trainer, device: torch.device, record: dict) -> None:
    config = TrainConfig(learning_rate=1e-5)
    num_seqs, seq_len = (4, 64) if args.tiny else (args.num_seqs, args.seq_len)
    vocab, moe_layers, k = model.config.vocab_size, trainer.decoder.num_moe_layers, model.config.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    prompt = seq_len // 8

    def sequences(replay: bool) -> list[TokenizedSequence]:
        out = []
        for i in range(num_seqs):
            ids = torch.randint(100, vocab - 100, (seq_len,), generator=g).tolist()
            sampled = (-torch.rand(seq_len - prompt, generator=g) * 3 - 0.5).tolist()
            routed = None
            if replay:  # k distinct experts per token and layer, as a router picks them
                routed = torch.rand(seq_len, moe_layers, model.config.num_experts, generator=g).argsort(-1)[..., :k]
                routed = routed.to(torch.int16).numpy()
                routed[-1] = -1
            out.append(TokenizedSequence(ids, [False] * prompt + [True] * (seq_len - prompt),
                                         [float("nan")] * prompt + sampled, advantage=1.0 if i % 2 else -1.0,
                                         trajectory_index=i, routed_experts=routed))
        return out

    results = {}
    for replay in (True, False):
        seqs = sequences(replay)
        trainer.step(seqs, config)  # warm-up: captures the CUDA graphs of this row shape
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.step(seqs, config)
        sync(device)
        seconds = (time.perf_counter() - start) / args.steps
        entry = {"tok_per_s": round(num_seqs * seq_len / seconds, 1), "s": round(seconds, 3)}
        if device.type == "cuda":
            entry.update(peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                         reserved_gib=round(torch.cuda.max_memory_reserved(device) / 2**30, 2))
        results["replay" if replay else "no_replay"] = entry
    record["train"] = {"workload": f"{num_seqs} x {seq_len} tokens, {seq_len - prompt} trained per sequence",
                       "graph_captures": trainer.rows.num_captures, "capture_error": trainer.rows.capture_error,
                       "forward": type(trainer.decoder).__name__, **results}


def replay_part(args, model, trainer: Trainer, device: torch.device, record: dict) -> None:
    from tempering.service.policies import AdapterPolicy
    from tempering.training.batching import pack_sequences

    class _Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    work = dict(num_prompts=8, n=4, max_new=64 if args.tiny else 128)
    engine = Engine(engine_model_for(model, 4096), _Tok(), stop_token_ids=[151645], lock=threading.RLock(),
                    config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, cpu_kv_cache_bytes=1 << 28),
                    max_seq_len=4096, peft_model=lambda: trainer.peft_model)
    prompts = make_prompts(work["num_prompts"], None, model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=work["max_new"], temperature=1.0, seed=5, ignore_eos=True, return_routed_experts=True)
    try:
        policy = AdapterPolicy(trainer.peft_model, "default", 1)
        samples = [(p, c) for p in prompts for c in engine.submit(p, params, n=work["n"], policy=policy).result()]
    finally:
        engine.close()
    sampled = torch.tensor([lp for _, c in samples for lp in c.logprobs])
    errors = {}
    for replay in (True, False):
        seqs = []
        for p, c in samples:
            routed = np.concatenate([c.routed_experts.astype(np.int16), np.full((1, *c.routed_experts.shape[1:]), -1, np.int16)])
            seqs.append(TokenizedSequence(p + c.token_ids, [False] * len(p) + [True] * len(c.token_ids),
                                          [float("nan")] * len(p) + c.logprobs, routed_experts=routed if replay else None))
        got = {}
        with torch.no_grad(), trainer._forward_mode(False):
            for micro in pack_sequences(seqs, max_tokens=8192):
                lp = trainer._logprobs(micro)[0].float().cpu()
                start = 0
                for s in micro.sequences:  # back to sample order
                    got[id(s)] = lp[start:start + s.num_completion_tokens]
                    start += s.num_completion_tokens
        errors[replay] = (torch.cat([got[id(s)] for s in seqs]) - sampled).abs()
    stats = {("with_replay" if replay else "without_replay"): {
        "mean": round(float(e.mean()), 5), "p99": round(float(e.quantile(0.99)), 5), "max": round(float(e.max()), 5)}
        for replay, e in errors.items()}
    record["replay"] = {"tokens": len(sampled), "dtype": str(model.dtype).removeprefix("torch."), **stats,
                        "tokens_off_beyond_replayed_max_without_replay": round(
                            float((errors[False] > errors[True].max()).float().mean()), 4)}


def write_expert_lora(config, lora_dir: Path, r: int = 8) -> Path:
    """A rank-`r` PEFT adapter (random non-zero A and B) on q/k/v/o and each expert's gate/up/down of a
    Qwen3-MoE `config`, in the per-expert layout ART exports for vLLM."""
    from safetensors.torch import save_file

    c = config
    g = torch.Generator().manual_seed(1)
    tensors = {}

    def lora(prefix: str, out: int, inp: int) -> None:
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(r, inp, generator=g) * 0.01).to(torch.bfloat16)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out, r, generator=g) * 0.02).to(torch.bfloat16)

    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for i in range(c.num_hidden_layers):
        base = f"base_model.model.model.layers.{i}"
        for name, out, inp in (("q_proj", q, c.hidden_size), ("k_proj", kv, c.hidden_size), ("v_proj", kv, c.hidden_size),
                               ("o_proj", c.hidden_size, q)):
            lora(f"{base}.self_attn.{name}", out, inp)
        for e in range(c.num_experts):
            for name, out, inp in (("gate_proj", c.moe_intermediate_size, c.hidden_size),
                                   ("up_proj", c.moe_intermediate_size, c.hidden_size),
                                   ("down_proj", c.hidden_size, c.moe_intermediate_size)):
                lora(f"{base}.mlp.experts.{e}.{name}", out, inp)
    lora_dir.mkdir(parents=True, exist_ok=True)
    (lora_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [*TARGETS, "experts"], "base_model_name_or_path": None}))
    save_file(tensors, lora_dir / "adapter_model.safetensors")
    return lora_dir


def run_vllm(shape: dict, path: str | None, launches: int = 1, rounds: int = 2) -> dict:
    """Workload R through vLLM + a rank-8 LoRA on q/k/v/o and each expert's gate/up/down: `launches`
    subprocesses one after the other, each timing R `rounds` times. Returns the first launch's JSON
    with R's figure the best of all runs and `lora_tok_per_s_runs` every run, in order."""
    from transformers import Qwen3MoeConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, lora_dir = Path(tmp) / "model", Path(tmp) / "lora"
        Qwen3MoeConfig(**shape, torch_dtype="bfloat16").save_pretrained(model_dir)
        write_expert_lora(Qwen3MoeConfig(**shape), lora_dir)
        results = [vllm_rollout.launch(model_dir, lora_dir, {"R": R}, path, rounds=rounds) for _ in range(launches)]
    if any("error" in r for r in results):
        return next(r for r in results if "error" in r)
    runs = [x for r in results for x in r["workloads"]["R"]["lora_tok_per_s_runs"]]
    out = results[0]
    out["workloads"]["R"] = {"lora_tok_per_s": max(runs), "lora_tok_per_s_runs": runs}
    out["lora_startup_s"] = [r["lora_startup_s"] for r in results]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="rollout,train", help="rollout, train, replay (comma-separated); "
                        "none: only the vLLM runs of --vllm")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide shape (checks the script)")
    parser.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--vllm", action="store_true", help="also run R through vLLM + LoRA (subprocess, first)")
    parser.add_argument("--vllm-launches", type=int, default=1,
                        help="vLLM subprocesses, one after the other, each timing R twice (the best run is compared)")
    parser.add_argument("--baseline-grouped-delta", action="store_true",
                        help="CUDA: also time R (without routed experts) with the expert LoRA as two grouped GEMMs "
                             "per projection (the trainer's path) instead of the engine's kernels, in the same run")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="CUDA: also time R in exact on-policy mode (EngineConfig.batch_invariant), after the "
                             "default engine's runs, on the same weights")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: profile a window of R's steady decoding after the timed runs: the GPU's busy "
                             "fraction, kernel time and count per step, and the longest kernels")
    parser.add_argument("--vllm-path", default=None, help="directories first on the vLLM subprocess's PYTHONPATH")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else QWEN3_30B_A3B
    parts = args.parts.split(",")
    vllm = run_vllm(shape, args.vllm_path, args.vllm_launches) if args.vllm else None
    if parts == ["none"]:  # `--vllm --parts none`: vLLM's figures alone
        print(json.dumps({"benchmark": "moe", "machine": machine(device), "vllm": vllm}))
        return
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    hw = measure_device(device) if device.type == "cuda" else None  # before the model takes the memory
    model = build_model(shape, device, dtype, near_tied=args.tiny and "replay" in parts)
    trainer = live_adapter(model)
    record: dict = {"benchmark": "moe", "device": args.device, "machine": machine(device), "torch": torch.__version__,
                    "model": ("tiny" if args.tiny else "Qwen3-30B-A3B") + "-shaped Qwen3-MoE, random weights",
                    "lora": "r=8 alpha=16: q/k/v/o, experts gate/up (fused, r=16) and down (PEFT target_parameters)",
                    "weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2)}
    if "rollout" in parts:
        rollout_part(args, model, trainer, device, record)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if vllm is not None:
        record["vllm"] = vllm
        v = vllm.get("workloads", {}).get("R", {}).get("lora_tok_per_s")
        if v and "rollout" in record:
            record["rollout"]["vs_vllm_lora"] = round(record["rollout"]["lora_routed_experts_tok_per_s"] / v, 2)
    if "replay" in parts:
        replay_part(args, model, trainer, device, record)
    if "train" in parts:
        train_part(args, model, trainer, device, record)
    if hw is not None:  # what the GPU allows (roofline.py), at its rates measured at the start
        record["hardware"] = hw
        moe = ModelShape.from_config(model.config)
        if "rollout" in record:
            work = TINY_R if args.tiny else R
            b = decode_bound(moe, hw, rows=work["num_prompts"] * work["n"], prompt=128, new=work["max_new"],
                             prompts=work["num_prompts"])
            record["rollout"]["bound"] = {**b, "fraction": round(record["rollout"]["lora_tok_per_s"] / b["tok_per_s"], 3)}
        if "train" in record:
            num_seqs, seq_len = (4, 64) if args.tiny else (args.num_seqs, args.seq_len)
            b = train_bound(moe, hw, tokens=num_seqs * seq_len, mean_context=seq_len / 2)
            record["train"]["bound"] = {**b, "fraction": round(b["bound_s"] / record["train"]["replay"]["s"], 3)}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
