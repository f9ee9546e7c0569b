"""Inference-only serving (`tempering serve --adapter`): rollouts with four adapters mixed in one batch
against one adapter alone, and peak GPU memory against serving a trainable model, in one run.

Prints one JSON line. The server is `AdapterServer` (what `tempering serve --adapter NAME=DIR`
runs), driven directly (no HTTP), with four random rank-8 LoRA adapters (A and B non-zero, on
q/k/v/o/gate/up/down) loaded from PEFT directories. Workload R (EOS ignored, every sample exactly
`max_new` tokens):

- GPU (default, `--device cuda`): Qwen2.5-1.5B-shaped model, random bf16 weights
  (`load_format="dummy"`), 32 random 128-token prompts x n=8, 256 new tokens, as
  `benchmarks/rollout.py`'s R;
- CPU (`--device cpu`, the smoke test): the default model (SmolLM2-135M-Instruct, float32),
  4 chat prompts x n=2, 8 new tokens.

Modes, timed in alternating rounds (base, one, mixed, then mixed, one, base; the mean of each):
`base` (no adapter), `one_adapter` (every request uses adapter 0) and `four_adapters_mixed`
(prompt i uses adapter i mod 4, all in the same batches). Each round starts with an empty prefix
cache; a full-length warm-up of every mode (and, on a GPU, every CUDA-graph batch size) runs first.

Memory (GPU): the peak allocated by torch (`torch.cuda.max_memory_allocated`) from before the
server loads to the end of its rollouts, against the same for a trainable model as
`tempering serve` holds it (ModelService: engine and trainer on the shared base weights), over
the same R rollouts with its live adapter and then one training step on them. Both engines get
the same KV cache (`num_kv_blocks`, room for the whole workload), so the difference is the
trainer's: LoRA gradients, Adam state, the step's activations. (Left to its defaults, an
inference-only server's engine gives 0.85 of the free memory to its KV cache, a trainable
model's 0.5: `INFERENCE_GPU_MEMORY_FRACTION`.)

    python benchmarks/serve_adapters.py                  # GPU
    python benchmarks/serve_adapters.py --device cpu     # CPU, tiny (the suite runs it)
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from rollout import QWEN_1_5B, machine, make_prompts, sync
from vllm_rollout import write_lora

from tempering.engine import EngineConfig, SamplingParams

WORKLOADS = {"cuda": dict(num_prompts=32, n=8, max_new=256), "cpu": dict(num_prompts=4, n=2, max_new=8)}
NUM_ADAPTERS = 4
MODES = ("base", "one_adapter", "four_adapters_mixed")


def base_dir(device: torch.device, tmp: Path) -> tuple[str, torch.dtype, str]:
    """(the base model to serve, its dtype, its load format): a Qwen2.5-1.5B-shaped config with the
    default model's tokenizer (random ids are sampled; the tokenizer only decodes) on a GPU, the
    default model on a CPU."""
    from transformers import AutoTokenizer, Qwen2Config

    from tempering.service.base_model import default_model_dir

    if device.type != "cuda":
        return str(default_model_dir()), torch.float32, "auto"
    path = tmp / "qwen2.5-1.5b-shape"
    config = Qwen2Config(**QWEN_1_5B, dtype="bfloat16")
    config.save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return str(path), torch.bfloat16, "dummy"


def policies_of(server, names: list[str]) -> dict[str, list]:
    """Each mode's policy per prompt index (`policies[mode][i % len]`)."""
    adapter = [server.resolve(name)[0].policy for name in names]
    return {"base": [server.resolve(server.base_name)[0].policy], "one_adapter": adapter[:1],
            "four_adapters_mixed": adapter}


def run_mode(engine, prompts: list[list[int]], work: dict, policies: list, max_new: int) -> list:
    params = SamplingParams(max_tokens=max_new, temperature=1.0, ignore_eos=True)
    futures = [engine.submit(p, params, n=work["n"], policy=policies[i % len(policies)]) for i, p in enumerate(prompts)]
    return [f.result() for f in futures]


def timed(engine, prompts, work, policies) -> float:
    """Seconds to sample the workload, from an empty prefix cache."""
    engine.blocks.forget_cached()
    sync(engine.device)
    start = time.perf_counter()
    results = run_mode(engine, prompts, work, policies, work["max_new"])
    sync(engine.device)
    elapsed = time.perf_counter() - start
    assert all(len(c.token_ids) == work["max_new"] for r in results for c in r)
    return elapsed


def warm(engine, prompts, work, policies) -> None:
    """A full-length run (no kernel compiles while timing) after every CUDA-graph batch size."""
    graphs = getattr(engine.runner, "graphs", None)
    for size in graphs.buckets if graphs is not None else []:
        run_mode(engine, [prompts[0][:16]], {"n": size}, policies, 3)
    run_mode(engine, prompts, work, policies, work["max_new"])


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def serve_adapters(model: str, dtype, adapters: list[Path], engine_config: EngineConfig,
                   prompts, work: dict, rounds: int, device: torch.device) -> dict:
    from tempering.service.adapter_server import AdapterServer

    reset_peak(device)
    server = AdapterServer(model, device=str(device), dtype=dtype, engine_config=engine_config)
    try:
        names = [f"adapter-{k}" for k in range(len(adapters))]
        for name, path in zip(names, adapters):
            server.add_adapter(name, path)
        engine, policies = server.engine, policies_of(server, names)
        for mode in MODES:
            warm(engine, prompts, work, policies[mode])
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                seconds[mode].append(timed(engine, prompts, work, policies[mode]))
        peak = peak_gib(device)
    finally:
        server.close()
    del server
    tokens = len(prompts) * work["n"] * work["max_new"]
    return {"tok_s": {mode: round(tokens * len(s) / sum(s), 1) for mode, s in seconds.items()}, "peak_gib": peak}


def serve_trainable(model: str, dtype, engine_config: EngineConfig, prompts, work: dict,
                    device: torch.device, tmp: Path) -> dict:
    """A trainable model as `tempering serve` holds it: the same R with its live adapter, then one step on it."""
    from tempering.service.service import ModelService
    from tempering.storage import ModelPaths
    from tempering.training import TokenizedSequence
    from tempering.types import TrainConfig

    reset_peak(device)
    service = ModelService(ModelPaths(tmp / "runs", "bench", "trainable"), model, device=str(device), dtype=dtype,
                           engine_config=engine_config)
    try:
        trainer = service._prepare_trainer(TrainConfig())  # the adapter a trained model serves, random and non-zero
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in trainer.params:
                p.copy_(torch.randn(p.shape, generator=g) * (0.01 if p.shape[0] == trainer.lora.rank else 0.02))
        live = [service.policy(None)]
        warm(service.engine, prompts, work, live)
        seconds = timed(service.engine, prompts, work, live)
        results = run_mode(service.engine, prompts, work, live, work["max_new"])
        sequences = [TokenizedSequence(p + c.token_ids, [False] * len(p) + [True] * len(c.token_ids),
                                       [float("nan")] * len(p) + c.logprobs, advantage=1.0 if (i + j) % 2 else -1.0)
                     for i, (p, r) in enumerate(zip(prompts, results)) for j, c in enumerate(r)]
        with service.gate:
            trainer.step(sequences, TrainConfig(learning_rate=1e-6))
        sync(device)
        peak = peak_gib(device)
    finally:
        service.close()
    tokens = len(prompts) * work["n"] * work["max_new"]
    return {"tok_s": round(tokens / seconds, 1), "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each mode (modes alternate)")
    parser.add_argument("--skip-trainable", action="store_true", help="leave out the trainable model's memory")
    args = parser.parse_args()
    device = torch.device(args.device)
    work = WORKLOADS["cuda" if device.type == "cuda" else "cpu"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model, dtype, load_format = base_dir(device, tmp)
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(model)
        adapters = [write_lora(config, tmp / f"adapter-{k}", seed=k + 1, dtype=dtype) for k in range(NUM_ADAPTERS)]
        tokenizer = None if device.type == "cuda" else AutoTokenizer.from_pretrained(model)
        prompts = make_prompts(work["num_prompts"], tokenizer, config.vocab_size, seed=0)
        longest = max(len(p) for p in prompts) + work["max_new"]
        num_blocks = work["num_prompts"] * work["n"] * (-(-longest // 16)) + 64  # the whole workload at once
        engine_config = EngineConfig(num_kv_blocks=num_blocks, load_format=load_format,
                                     max_num_seqs=max(256, work["num_prompts"] * work["n"]))
        inference = serve_adapters(model, dtype, adapters, engine_config, prompts, work, args.rounds, device)
        trainable = None if args.skip_trainable else serve_trainable(model, dtype, engine_config, prompts,
                                                                     work, device, tmp)
    tok_s = inference["tok_s"]
    record = {
        "benchmark": "serve_adapters",
        "machine": machine(device),
        "device": device.type,
        "model": "qwen2.5-1.5b-shape (random bf16)" if device.type == "cuda" else "SmolLM2-135M-Instruct (float32)",
        "workload_R": {**work, "num_adapters": NUM_ADAPTERS, "lora_rank": 8, "kv_blocks": num_blocks},
        "rounds": args.rounds,
        "tok_s": tok_s,
        "mixed_vs_one_adapter": round(tok_s["four_adapters_mixed"] / tok_s["one_adapter"], 3),
        "one_adapter_vs_base": round(tok_s["one_adapter"] / tok_s["base"], 3),
        "peak_gib": {"inference_only": inference["peak_gib"],
                     "trainable": trainable["peak_gib"] if trainable else None},
        "trainable_live_adapter_tok_s": trainable["tok_s"] if trainable else None,
    }
    if trainable and inference["peak_gib"] and trainable["peak_gib"]:
        record["peak_inference_vs_trainable"] = round(inference["peak_gib"] / trainable["peak_gib"], 3)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
