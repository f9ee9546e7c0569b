"""Rollout throughput on the RL path: the engine with and without the live LoRA adapter, in one run.

Prints one JSON line. Workloads (EOS ignored, so every sample has exactly max_new tokens; the
logprob of every sampled token returned):

- GPU (`--device cuda`, Qwen2.5-1.5B-shaped model, random bf16 weights, 128-token prompts):
  R = 32 prompts × n=8, 256 new; 1024x1 = 1024 distinct prompts × 1, 256 new;
  long = 64 prompts × n=8, 2048 new.
- CPU (default model, SmolLM2-135M-Instruct, fp32, chat prompts): R = 8 prompts × n=4, 64 new;
  distinct = 32 prompts × 1, 64 new; long = 4 prompts × n=4, 512 new.

Each workload runs with the base weights and with a live LoRA adapter (rank 8, alpha 16, on
q/k/v/o/gate/up/down, A and B non-zero: the trainer's tensors, as every rollout after step 0
uses). Both are warmed up with the same prompts and shapes, the CUDA graphs of every decode
batch size are captured first, the first round's warm-up samples the full length (so that no
kernel compiles while timing), and the prefix cache is emptied before timing. The modes
alternate, base, lora, then lora, base (`--rounds`), and each reports its mean: a GPU's clock
drifts as it heats, which favoured whichever mode ran first. `model.generate` is timed on R after a full-length
warm-up call. Also reported: logprob error against a transformers(+PEFT) forward, the adapter
switch time after a training step, and with `--profile` the fraction of a decode step the GPU is
busy. `--vllm` runs the same workloads through vLLM (with and without a rank-8 LoRA) in a
subprocess first, in the same run, and prints the ratios.

    python benchmarks/rollout.py                              # CPU
    python benchmarks/rollout.py --device cuda --profile      # GPU
    python benchmarks/rollout.py --device cuda --vllm         # GPU, against vLLM
    python benchmarks/rollout.py --device cuda --response-format json_schema --qwen-tiktoken PATH

`--response-format json_schema` / `--guided-choice` add workload R with the live adapter under a
grammar (structured outputs) and its ratio to the free run; on the random GPU model the grammar
needs Qwen's vocabulary (`qwen.tiktoken` from the PyPI package `dashscope`).

`--gpus N` measures rollouts over N engine replicas, one process per GPU, against one GPU in the
same run, with the live adapter (`--modes base,lora` for both): this process times each workload
on GPU 0 through the router (parallel/router.py) with its own replica only, then starts ranks
1..N-1 (parallel/launch.py), each with the same model, adapter and engine, and times the same
workload through the router over all N replicas (strong scaling), and N times the prompts
(weak scaling: the same load per GPU). Requests reach the other ranks over the control channel
(parallel/channel.py), as in `tempering serve --gpus N`. Also reported: requests per replica and
the greatest logprob difference between the replicas on a greedy probe. `--model 32b` is
Qwen2.5-32B-shaped (61 GiB of bf16 weights per GPU; workload R by default).

    python benchmarks/rollout.py --device cuda --gpus 2
    python benchmarks/rollout.py --device cuda --gpus 2 --model 32b
    python benchmarks/rollout.py --device cpu --gpus 2 --workloads R      # 2 CPU processes (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import vllm_rollout
from tempering.chat import ChatRenderer
from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.engine.cpu_threads import run_in_own_thread

GPU_WORKLOADS = {
    "R": dict(num_prompts=32, n=8, max_new=256),
    "1024x1": dict(num_prompts=1024, n=1, max_new=256),
    "long": dict(num_prompts=64, n=8, max_new=2048),
}
CPU_WORKLOADS = {
    "R": dict(num_prompts=8, n=4, max_new=64),
    "distinct": dict(num_prompts=32, n=1, max_new=64),
    "long": dict(num_prompts=4, n=4, max_new=512),
}
PROMPT_LEN = 128
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"])
QWEN_32B = dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"])
SHAPES = {"1.5b": QWEN_1_5B, "32b": QWEN_32B}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def load_cpu_model(dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tempering.service.base_model import default_model_dir

    path = default_model_dir()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


def build_gpu_model(device: torch.device, shape: str = "1.5b"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 32B model in fp32 would not fit the GPU
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape]))
    finally:
        torch.set_default_dtype(default)
    return model.eval(), None


def make_prompts(count: int, tokenizer, vocab: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts: random 128-token ids (GPU), or chat prompts of the default model (CPU)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(100, vocab - 100, (PROMPT_LEN,), generator=g).tolist() for _ in range(count)]
    renderer = ChatRenderer(tokenizer)
    topics = ["the sea", "a robot", "the moon", "a city", "winter", "a dragon", "music", "a garden"]
    return [renderer.render_prompt([{"role": "user", "content": f"Tell me a long story about {topics[i % 8]} ({seed}.{i})."}])
            for i in range(count)]


def add_live_adapter(model) -> object:
    """The trainer's rank-8 LoRA on every linear layer, with random non-zero A and B."""
    from tempering.training import Trainer
    from tempering.types import LoRAConfig

    trainer = Trainer.new(model, LoRAConfig(rank=8, alpha=16))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.params:
            p.copy_(torch.randn(p.shape, generator=g) * (0.01 if p.shape[0] == 8 else 0.02))
    return trainer


def capture_all_graphs(engine: Engine, prompt: list[int], policy) -> None:
    """Decode batches of every CUDA-graph bucket for `policy`, so that no graph is captured while timing."""
    graphs = engine.runner.graphs
    for size in graphs.buckets if graphs is not None else []:
        engine.submit(prompt, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True), n=size, policy=policy).result()


def time_engine(engine: Engine, prompts, work: dict, policy, grammar=None, *, full_warm: bool = False) -> tuple[float, list]:
    """Seconds to sample the workload (after a warm-up with the same prompts), and the results.

    `grammar`: every sample follows it (structured outputs); it must not be able to finish
    within the workload's new tokens, so that both sides sample the same number of tokens.
    `full_warm`: the warm-up samples the workload's full length instead of 8 tokens, so that the
    Triton kernels of every batch shape it meets are compiled before timing (a first use of a
    shape can stall a step for 0.5-2.5 s on a fresh machine: measured on an H100).
    """
    capture_all_graphs(engine, prompts[0][:16], policy)
    warm = SamplingParams(max_tokens=work["max_new"] if full_warm else 8, temperature=1.0, ignore_eos=grammar is None,
                          grammar=grammar)
    for f in [engine.submit(p, warm, n=work["n"], policy=policy) for p in prompts]:
        f.result()
    engine.blocks.forget_cached()
    params = SamplingParams(max_tokens=work["max_new"], temperature=1.0, ignore_eos=grammar is None, grammar=grammar)
    sync(engine.device)
    start = time.perf_counter()
    futures = [engine.submit(p, params, n=work["n"], policy=policy) for p in prompts]
    results = [f.result() for f in futures]
    sync(engine.device)
    elapsed = time.perf_counter() - start
    assert all(len(c.token_ids) == work["max_new"] for r in results for c in r)
    return elapsed, results


def gpu_busy_fraction(engine: Engine, prompts, work: dict, policy, window_s: float = 0.3) -> float:
    """Kernel time / wall time over a window of steady decoding (torch.profiler; an untimed extra run).

    The profiler starts once the prompts are prefilled and the batch decodes; the fraction is the
    sum of kernel durations over the window's wall time (one stream: kernels do not overlap).
    """
    from torch.profiler import ProfilerActivity, profile

    engine.blocks.forget_cached()
    params = SamplingParams(max_tokens=work["max_new"], temperature=1.0, ignore_eos=True)
    decoded = engine.stats.num_decode_tokens
    futures = [engine.submit(p, params, n=work["n"], policy=policy) for p in prompts]
    while engine.stats.num_decode_tokens < decoded + len(prompts) * work["n"] * 8:  # past the prefill: decoding
        time.sleep(0.001)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sync(engine.device)
        start = time.perf_counter()
        time.sleep(window_s)
        sync(engine.device)
        wall = time.perf_counter() - start
    for f in futures:
        f.result()
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    return round(kernel_us / 1e6 / wall, 3)


def time_generate(model, prompts, work: dict, device) -> float:
    """`model.generate` on the workload, timed after one full-length warm-up call."""
    rows = [p for p in prompts for _ in range(work["n"])]
    width = max(len(p) for p in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(rows):  # left padding
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=work["max_new"],
                  min_new_tokens=work["max_new"], pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)  # full-length warm-up
        sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
        sync(device)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == work["max_new"]
    return elapsed


def logprob_error(forward, prompts, results, device) -> tuple[float, float]:
    """Mean and max |engine logprob - reference forward logprob| over a few samples."""
    diffs = []
    with torch.inference_mode():
        for p, r in list(zip(prompts, results))[:4]:
            c = r[0]
            ids = torch.tensor([p + c.token_ids], device=device)
            logits = forward(ids).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / c.logprob_temperature, -1).gather(1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0]
            diffs.append((ref.cpu() - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return round(float(d.mean()), 5), round(float(d.max()), 5)


def adapter_switch(engine: Engine, trainer, prompts, results) -> dict:
    """Latency of a 4-token request right after a training step minus the same with no step (medians of 5)."""
    from tempering.service.policies import AdapterPolicy
    from tempering.training import TokenizedSequence
    from tempering.types import TrainConfig

    seqs = []
    for j, (p, r) in enumerate(zip(prompts[:8], results[:8])):
        c = r[0]
        seqs.append(TokenizedSequence(p + c.token_ids[:64], [False] * len(p) + [True] * 64,
                                      [float("nan")] * len(p) + c.logprobs[:64], advantage=1.0 if j % 2 else -1.0))
    config = TrainConfig(learning_rate=1e-6)
    probe = prompts[0][:32]

    def latency(version: int, train: bool) -> float:
        if train:
            with engine.lock:
                trainer.step(seqs, config)
        sync(engine.device)
        start = time.perf_counter()
        engine.submit(probe, SamplingParams(max_tokens=4, temperature=0), policy=AdapterPolicy(trainer.peft_model, "default", version)).result()
        return time.perf_counter() - start

    latency(1, train=True)
    after, before = [], []
    for k in range(5):
        after.append(latency(100 + 2 * k, train=True))
        before.append(latency(101 + 2 * k, train=False))
    return {"adapter_switch_ms": round((sorted(after)[2] - sorted(before)[2]) * 1e3, 2),
            "request_latency_after_step_ms": round(sorted(after)[2] * 1e3, 2)}


def structured_grammar(args, tokenizer, vocab_size: int):
    """The grammar of `--response-format json_schema` (RULER's score list for 32 trajectories, longer
    than any workload's new tokens) or `--guided-choice` (4 choices of ~400 words), compiled."""
    from tempering.engine.grammar import GrammarCompiler, GrammarSpec
    from tempering.rewards.ruler import judge_schema

    if tokenizer is None:  # the random GPU model: Qwen's vocabulary from dashscope's qwen.tiktoken
        import llguidance
        from structured_outputs import QWEN_PATTERN, QWEN_SPECIALS, QWEN_VOCAB, qwen_ranks

        if not args.qwen_tiktoken:
            raise SystemExit("structured outputs on the random GPU model need --qwen-tiktoken PATH")
        tokenizer = llguidance.LLTokenizer.from_tiktoken(encoder=qwen_ranks(Path(args.qwen_tiktoken)),
                                                         special_tokens=QWEN_SPECIALS, pattern=QWEN_PATTERN,
                                                         eos_token=151645, n_vocab=QWEN_VOCAB)
        stop = [151645]
    else:
        stop = [tokenizer.eos_token_id]
    compiler = GrammarCompiler(tokenizer, stop_token_ids=stop, vocab_size=vocab_size)
    if args.response_format == "json_schema":
        return "json_schema", compiler.compile(GrammarSpec.json_schema(judge_schema(32)))
    words = ["alpha", "river", "stone", "cloud", "maple", "orbit", "lantern", "violet"]
    choices = [" ".join(words[(i * 7 + j) % 8] for j in range(400)) + f" ({i})" for i in range(4)]
    return "guided_choice", compiler.compile(GrammarSpec.choice(choices))


def run_vllm(workloads: dict, names: list[str], path: str | None = None, modes: tuple[str, ...] = ("base", "lora")) -> dict:
    """The same workloads through vLLM in a subprocess (before this process touches the GPU).

    `path`: directories put first on the subprocess's PYTHONPATH (vLLM pins its own versions of
    packages tempering also uses, e.g. llguidance < 1.4 against tempering's >= 1.9)."""
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import Qwen2Config

        model_dir, lora_dir = vllm_rollout.write_model_and_lora(Qwen2Config(**QWEN_1_5B), Path(tmp))
        spec = {n: workloads[n] for n in names}
        merged: dict = {"workloads": {}}
        for adapter in [lora_dir if mode == "lora" else None for mode in modes]:  # one process per mode:
            # each vLLM instance gets the whole GPU
            result = vllm_rollout.launch(model_dir, adapter, spec, path)
            if "error" in result:
                merged.setdefault("error", []).append(result["error"])
                continue
            for name, figures in result.pop("workloads").items():
                merged["workloads"].setdefault(name, {}).update(figures)
            merged.update(result)
        return merged


class Replica:
    """One rank's engine with the benchmark's policies: rank 0 calls it directly, the other ranks
    serve it over the control channel (`submit` for generations, the rest as calls)."""

    def __init__(self, engine: Engine, policies: dict) -> None:
        self.engine = engine
        self.policies = policies
        self.mode = "lora"
        self._window = [None, None, 0]  # first request in, last completion out (time.monotonic), steps before

    def submit(self, *, prompt_ids, params, n, step=None, on_token=None):
        if self._window[0] is None:
            self._window[0] = time.monotonic()
        future = self.engine.submit(prompt_ids, params, n=n, policy=self.policies[self.mode], on_token=on_token)
        future.add_done_callback(lambda _: self._window.__setitem__(1, time.monotonic()))
        return future

    def window(self) -> tuple[float | None, float | None, int]:
        """Since `prepare`: when this replica's first request arrived and its last one completed
        (time.monotonic, one clock for every process of the machine), and its engine steps."""
        first, last, steps = self._window
        return first, last, self.engine.stats.num_steps - steps

    def prepare(self, *, mode: str, prompts: list[list[int]], n: int, max_new: int = 8) -> None:
        """Switch policy, capture every decode graph, warm up on the workload's prompts (`max_new`
        tokens each: the full length compiles every kernel shape the run meets), empty the prefix cache."""
        self.mode = mode
        policy = self.policies[mode]
        capture_all_graphs(self.engine, prompts[0][:16], policy)
        warm = SamplingParams(max_tokens=max_new, temperature=1.0, ignore_eos=True)
        for f in [self.engine.submit(p, warm, n=n, policy=policy) for p in prompts]:
            f.result()
        self.engine.blocks.forget_cached()
        self._window = [None, None, self.engine.stats.num_steps]

    def probe(self, *, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        c = self.engine.submit(prompt_ids, SamplingParams(max_tokens=16, temperature=0.0),
                               policy=self.policies[self.mode]).result()[0]
        return c.token_ids, c.logprobs


def build_replica(args, device: torch.device):
    """The model (random GPU shape, or the default model on CPU), its live adapter and an engine."""
    from tempering.service.policies import AdapterPolicy

    gpu = device.type == "cuda"
    model, tokenizer = build_gpu_model(device, args.model) if gpu else load_cpu_model(getattr(torch, args.cpu_dtype))

    class _Tok:  # random-weight GPU model: no tokenizer; EOS ignored anyway
        def decode(self, ids, skip_special_tokens=True):
            return ""

    holder = {"peft": None}
    engine = Engine(
        engine_model_for(model, 4096), tokenizer or _Tok(), stop_token_ids=[0], lock=threading.RLock(),
        config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, cpu_kv_cache_bytes=1 << 30),
        max_seq_len=4096, peft_model=lambda: holder["peft"],
    )
    trainer = add_live_adapter(model)
    holder["peft"] = trainer.peft_model
    replica = Replica(engine, {"base": BasePolicy(), "lora": AdapterPolicy(trainer.peft_model, "default", 1)})
    return replica, model, tokenizer


def data_parallel(args) -> None:
    """`--gpus N` (see the module docstring). Every process runs this: rank 0 is the one the user
    started; ranks 1..N-1 are started by it with torchrun's variables and serve their replica."""
    import torch.distributed as dist

    from tempering.parallel import Driver, Router, join, serve

    device_type = torch.device(args.device).type
    if int(os.environ.get("RANK", "0")) > 0:  # a worker: its replica, served until rank 0 is done
        info, conn, _store = join(device_type=device_type, timeout_s=1800)
        if device_type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.gpus))
        replica, _, _ = build_replica(args, info.device)
        serve(conn, replica, rank=info.rank)
        replica.engine.close()
        dist.destroy_process_group()
        return
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.gpus))
    replica, model, tokenizer = build_replica(args, device)
    gpu = device_type == "cuda"
    workloads = GPU_WORKLOADS if gpu else CPU_WORKLOADS
    default_names = ["R"] if args.model == "32b" or not gpu else list(workloads)
    names = args.workloads.split(",") if args.workloads else default_names
    modes = args.modes.split(",")
    vocab = model.config.vocab_size

    def run(router: Router, prepares: list, prompts: list[list[int]], work: dict, mode: str, windows: list = ()) -> dict:
        """Tokens/s of the workload through `router` after every replica prepared for it; with
        `windows` (one function per replica), when each replica worked, relative to the start."""
        remote = [prepare(mode=mode, prompts=prompts, n=work["n"], max_new=work["max_new"]) for prepare in prepares[1:]]
        prepares[0](mode=mode, prompts=prompts, n=work["n"], max_new=work["max_new"])
        for f in remote:
            f.result()
        before = list(router.num_requests)
        params = SamplingParams(max_tokens=work["max_new"], temperature=1.0, ignore_eos=True)
        sync(device)
        start, start_mono = time.perf_counter(), time.monotonic()
        futures = [router.submit(p, params, n=work["n"]) for p in prompts]
        submitted = time.monotonic() - start_mono
        results = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
        assert all(len(c.token_ids) == work["max_new"] for r in results for c in r)
        out = {"tok_per_s": round(len(prompts) * work["n"] * work["max_new"] / elapsed, 1),
               "requests_per_replica": [a - b for a, b in zip(router.num_requests, before)]}
        if windows:  # [first request in, last completion out] per replica, seconds after the start
            spans = [w() for w in windows]
            out["timeline_s"] = {"wall": round(elapsed, 3), "all_submitted": round(submitted, 3),
                                 "replicas": [[round(f - start_mono, 3), round(l - start_mono, 3), steps]
                                              for f, l, steps in spans if f is not None and l is not None]}
        return out

    def local(prompt_ids, params, *, n, step, on_token):
        return replica.submit(prompt_ids=prompt_ids, params=params, n=n, on_token=on_token)

    record: dict = {"benchmark": "rollout_data_parallel", "device": args.device, "gpus": args.gpus,
                    "machine": machine(device), "engine_returns_logprobs": True, "torch": torch.__version__,
                    "model": f"Qwen2.5-{args.model}-shaped random bf16" if gpu else f"SmolLM2-135M-Instruct {args.cpu_dtype}",
                    "replicas": "one engine per GPU, whole model on each (no tensor parallelism)", "workloads": {}}
    single = Router([local])
    for mode in modes:
        for k, name in enumerate(names):
            work = workloads[name]
            prompts = make_prompts(work["num_prompts"], tokenizer, vocab, seed=10 * k)
            entry = record["workloads"].setdefault(name, {"shape": work})
            entry[f"{mode}_1gpu_tok_per_s"] = run(single, [replica.prepare], prompts, work, mode)["tok_per_s"]
            # one GPU's share of the fixed batch, alone: what each of N replicas has to do
            share = prompts[: max(1, len(prompts) // args.gpus)]
            alone = run(single, [replica.prepare], share, work, mode, [replica.window])
            entry[f"{mode}_1gpu_share_of_{args.gpus}_s"] = alone["timeline_s"]["wall"]

    driver = Driver.start(args.gpus, device_type=device_type, command=[sys.executable, *sys.argv], timeout_s=1800)
    try:
        remotes = [lambda prompt_ids, params, *, n, step, on_token, link=link: link.submit(
            {"prompt_ids": prompt_ids, "params": params, "n": n}, on_token) for link in driver.links]
        prepares = [replica.prepare, *[lambda link=link, **kw: link.call("prepare", **kw) for link in driver.links]]
        multi = Router([local, *remotes])
        for mode in modes:
            for k, name in enumerate(names):
                work = workloads[name]
                prompts = make_prompts(work["num_prompts"], tokenizer, vocab, seed=10 * k)
                entry = record["workloads"][name]
                windows = [replica.window, *[lambda link=link: link.call("window").result() for link in driver.links]]
                # twice: the first multi-process run of a workload has been up to 1.7x slower than the
                # next (2x H100, 2026-11-26); both are reported, the better one is the ratio's
                strongs = [run(multi, prepares, prompts, work, mode, windows) for _ in range(2)]
                strong = max(strongs, key=lambda r: r["tok_per_s"])
                more = make_prompts(work["num_prompts"] * args.gpus, tokenizer, vocab, seed=10 * k + 5)
                weak = run(multi, prepares, more, work, mode)
                single_tps = entry[f"{mode}_1gpu_tok_per_s"]
                entry.update({
                    f"{mode}_{args.gpus}gpu_tok_per_s": strong["tok_per_s"],
                    f"{mode}_{args.gpus}gpu_tok_per_s_runs": [r["tok_per_s"] for r in strongs],
                    f"{mode}_bound_ratio": round(work["num_prompts"] * work["n"] * work["max_new"] / single_tps
                                                 / entry[f"{mode}_1gpu_share_of_{args.gpus}_s"], 3),
                    f"{mode}_ratio": round(strong["tok_per_s"] / single_tps, 3),
                    f"{mode}_{args.gpus}gpu_{args.gpus}x_prompts_tok_per_s": weak["tok_per_s"],
                    f"{mode}_ratio_{args.gpus}x_prompts": round(weak["tok_per_s"] / single_tps, 3),
                    f"{mode}_requests_per_replica": strong["requests_per_replica"],
                    f"{mode}_{args.gpus}gpu_timeline_s": strong["timeline_s"],
                })
        probe_prompt = make_prompts(1, tokenizer, vocab, seed=99)[0]
        probes = [replica.probe(prompt_ids=probe_prompt)] + [link.call("probe", prompt_ids=probe_prompt).result()
                                                             for link in driver.links]
        record["replicas_same_greedy_tokens"] = all(p[0] == probes[0][0] for p in probes)
        record["replicas_max_logprob_diff"] = round(max(abs(a - b) for p in probes[1:]
                                                        for a, b in zip(p[1], probes[0][1])), 6)
    finally:
        driver.close()
        replica.engine.close()
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default=None, help="comma-separated subset of the workloads")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--skip-lora", action="store_true")
    parser.add_argument("--profile", action="store_true", help="GPU busy fraction during R with the live adapter")
    parser.add_argument("--vllm", action="store_true", help="also run the workloads through vLLM (subprocess)")
    parser.add_argument("--vllm-path", default=None, help="directories first on the vLLM subprocess's PYTHONPATH")
    parser.add_argument("--vllm-modes", default="base,lora", help="with --vllm: base, lora or base,lora")
    parser.add_argument("--cpu-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--response-format", choices=["json_schema"], default=None,
                        help="also run R with the live adapter under a JSON schema (RULER's score list)")
    parser.add_argument("--guided-choice", action="store_true", help="also run R with the live adapter under a guided choice")
    parser.add_argument("--qwen-tiktoken", default=None, help="GPU structured outputs: dashscope's resources/qwen.tiktoken")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each workload and mode (modes alternate)")
    parser.add_argument("--gpus", type=int, default=1, help="engine replicas on this many GPUs, against one GPU")
    parser.add_argument("--model", default="1.5b", choices=sorted(SHAPES), help="GPU model shape")
    parser.add_argument("--modes", default="lora", help="with --gpus: base, lora or base,lora")
    args = parser.parse_args()
    if args.gpus > 1:
        data_parallel(args)
        return
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    workloads = GPU_WORKLOADS if gpu else CPU_WORKLOADS
    names = args.workloads.split(",") if args.workloads else (list(workloads) if gpu else ["R"])

    vllm = run_vllm(workloads, names, args.vllm_path, tuple(args.vllm_modes.split(","))) if args.vllm else None
    # on a CPU the torch work of this script runs off the main thread, as a backend's does: an OpenMP
    # pool kept by the main thread would make the engine's workers sleep between products
    # (engine/cpu_threads.py)
    if gpu:
        model, tokenizer = build_gpu_model(device, args.model)
    else:
        model, tokenizer = run_in_own_thread(load_cpu_model, getattr(torch, args.cpu_dtype))
    vocab = model.config.vocab_size

    class _Tok:  # random-weight GPU model: no tokenizer; EOS ignored anyway
        def decode(self, ids, skip_special_tokens=True):
            return ""

    generate_s = None
    if not args.skip_generate and "R" in names:  # first: the trainer below changes the model's settings
        prompts = make_prompts(workloads["R"]["num_prompts"], tokenizer, vocab, seed=7)
        generate_s = run_in_own_thread(time_generate, model, prompts, workloads["R"], device)

    holder = {"peft": None}
    # the grammar's stop id (Qwen's <|im_end|> on the random model): under a grammar a sample ends only
    # when its grammar does, which no workload's budget allows (token 0 is an ordinary token there)
    engine = run_in_own_thread(lambda: Engine(
        engine_model_for(model, 4096), tokenizer or _Tok(), stop_token_ids=[tokenizer.eos_token_id if tokenizer else 151645],
        lock=threading.RLock(), config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, cpu_kv_cache_bytes=1 << 30),
        max_seq_len=4096, peft_model=lambda: holder["peft"],
    ))
    record: dict = {"benchmark": "rollout", "device": args.device, "machine": machine(device),
                    "model": "Qwen2.5-1.5B-shaped random bf16" if gpu else f"SmolLM2-135M-Instruct {args.cpu_dtype}",
                    "engine_returns_logprobs": True, "torch": torch.__version__, "workloads": {}}
    trainer = None
    policies = {"base": BasePolicy()}
    if not args.skip_lora:
        from tempering.service.policies import AdapterPolicy

        trainer = run_in_own_thread(add_live_adapter, model)
        holder["peft"] = trainer.peft_model
        policies["lora"] = AdapterPolicy(trainer.peft_model, "default", 1)
    modes = list(policies)
    for k, name in enumerate(names):
        work = workloads[name]
        tokens = work["num_prompts"] * work["n"] * work["max_new"]
        entry = record["workloads"].setdefault(name, {"shape": work})
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        # modes alternate (base, lora, then lora, base, ...): a GPU's clock drifts as it heats, so
        # running one mode after the other would favour the first
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                prompts = make_prompts(work["num_prompts"], tokenizer, vocab, seed=10 * k + (mode == "lora"))
                seconds, results = time_engine(engine, prompts, work, policies[mode], full_warm=r == 0)
                runs[mode].append(tokens / seconds)
                if r == 0 and k == 0:  # the base reference with the adapter (injected into the model) turned off
                    off = trainer.peft_model.disable_adapter() if trainer is not None and mode == "base" else nullcontext()
                    with off:
                        forward = trainer.peft_model if trainer is not None else model
                        record[f"{mode}_logprob_abs_err_mean_max"] = run_in_own_thread(
                            logprob_error, forward, prompts, results, device)
                if r == 0 and mode == "lora" and k == 0:
                    switch_results = results
        for mode in modes:
            entry[f"{mode}_tok_per_s"] = round(sum(runs[mode]) / len(runs[mode]), 1)
            entry[f"{mode}_tok_per_s_runs"] = [round(x, 1) for x in runs[mode]]
            if args.profile and gpu and name == "R":
                prompts = make_prompts(work["num_prompts"], tokenizer, vocab, seed=10 * k + (mode == "lora"))
                entry[f"{mode}_gpu_busy_fraction"] = gpu_busy_fraction(engine, prompts, work, policies[mode])
    if (args.response_format or args.guided_choice) and trainer is not None and "R" in names:
        kind, grammar = structured_grammar(args, tokenizer, vocab)
        work, entry = workloads["R"], record["workloads"]["R"]
        prompts = make_prompts(work["num_prompts"], tokenizer, vocab, seed=1)  # the prompts of R's live-adapter run
        tokens = work["num_prompts"] * work["n"] * work["max_new"]
        runs = {"free": [], kind: []}
        for i, label in enumerate(("free", kind, kind, "free")):  # interleaved, as above
            seconds, _ = time_engine(engine, prompts, work, policies["lora"], grammar=grammar if label == kind else None,
                                     full_warm=i < 2)
            runs[label].append(tokens / seconds)
        constrained, free = (sum(runs[x]) / 2 for x in (kind, "free"))
        entry[f"lora_{kind}_tok_per_s"] = round(constrained, 1)
        entry[f"lora_{kind}_free_tok_per_s"] = round(free, 1)
        entry[f"lora_{kind}_vs_free"] = round(constrained / free, 3)
    for name, entry in record["workloads"].items():
        if "lora_tok_per_s" in entry:
            entry["lora_vs_base"] = round(entry["lora_tok_per_s"] / entry["base_tok_per_s"], 3)
        if vllm and name in vllm.get("workloads", {}):
            v = vllm["workloads"][name]
            entry["vllm"] = v
            for mode in ("base", "lora"):
                if f"{mode}_tok_per_s" in entry and v.get(f"{mode}_tok_per_s"):
                    entry[f"{mode}_vs_vllm_{mode}"] = round(entry[f"{mode}_tok_per_s"] / v[f"{mode}_tok_per_s"], 2)
    if gpu:  # what the GPU allows (roofline.py), at its rates measured now
        from roofline import ModelShape, decode_bound, measure_device

        record["hardware"] = measure_device(device)
        shape = ModelShape.from_config(model.config)
        for name, entry in record["workloads"].items():
            work = workloads[name]
            b = decode_bound(shape, record["hardware"], rows=work["num_prompts"] * work["n"], prompt=PROMPT_LEN,
                             new=work["max_new"], prompts=work["num_prompts"])
            entry["bound"] = {**b, **{f"{mode}_fraction": round(entry[f"{mode}_tok_per_s"] / b["tok_per_s"], 3)
                                      for mode in modes}}
    if vllm is not None and "error" in vllm:
        record["vllm_error"] = vllm["error"]
    if generate_s is not None:
        work, entry = workloads["R"], record["workloads"]["R"]
        entry["generate_warm_tok_per_s"] = round(work["num_prompts"] * work["n"] * work["max_new"] / generate_s, 1)
        entry["base_vs_generate"] = round(entry["base_tok_per_s"] / entry["generate_warm_tok_per_s"], 2)
    if trainer is not None:
        probes = make_prompts(8, tokenizer, vocab, seed=99)
        record.update(run_in_own_thread(adapter_switch, engine, trainer, probes, switch_results))
    engine.close()
    print(json.dumps(record))


if __name__ == "__main__":
    main()
