"""Structured outputs: the grammar libraries compared, and the engine with and without a schema.

Two measurements, each printing one JSON line:

    python benchmarks/structured_outputs.py libs [--qwen-tiktoken PATH] [--batch 32 256]
    python benchmarks/structured_outputs.py engine [--device cpu]
    python benchmarks/structured_outputs.py threads [--qwen-tiktoken PATH] [--batch 256]

`libs` times what the engine asks of a grammar library, for llguidance and (when installed)
xgrammar, on a RULER-like schema (`rewards.ruler.judge_schema(8)`: a list of 8 objects with a
const id, an explanation of at most 200 characters and a score in [0, 1]):
- compile: spec → a matcher at its start state, cold (5 distinct schemas, median);
- fill: one step's bitmasks for B rows, each matcher at its own position in a valid answer
  (teacher-forced along 60 steps, median), with the library's thread pool;
- consume: advancing the B matchers by their sampled tokens (median).
Vocabularies: SmolLM2's (49,152, the default model's tokenizer) and Qwen's (151,643 BPE ranks,
padded to the model's 151,936 logits), read from the `qwen.tiktoken` file that the PyPI package
`dashscope` ships (`pip download --no-deps dashscope` and unzip `dashscope/resources/qwen.tiktoken`).

`threads` times one decode step's grammar work (B matchers of `judge_schema(32)` consume their
sampled tokens, then B masks are filled; tokens drawn at random from each row's mask): matchers
copied from one compiled grammar, with llguidance's executor at its default thread count and at
1, 2 and 4 threads, and as one call per row from Python; with llguidance's executor at
`default_num_shards()` threads over matchers spread over that many copies and sorted by copy
(`pool_over_copies`); and as the engine does it
(`engine_shards`: matchers spread over `default_num_shards()` separately compiled copies, one helper thread
per copy, `MaskWorker`), alone and while the submitting thread runs `--busy-ms` of Python
(`engine_shards_busy`, as the engine thread processes tokens and schedules meanwhile (a third of it,
then `wait_filling`), then prepares the next step:
"serial_ms" is what it costs if the two do not overlap, "ideal_ms" if they fully do). With llguidance 1.9 the first kind does not scale with threads. With `--qwen-tiktoken` the Qwen vocabulary, else SmolLM2's.

`engine` runs the rollout engine on the default model (CPU, fp32; rollout.py's workload R: 8 chat
prompts × n=4, 64 new tokens, base weights) in one process: free sampling (EOS ignored) and every sample under
`judge_schema(32)`, which cannot complete within 64 tokens, so both runs generate exactly the
same number of tokens. The ratio is the cost of structured outputs (mask fill, apply, advance).
With `--device cuda` it uses rollout.py's random Qwen2.5-1.5B-shaped model (32 × n=8, 256 new
tokens) with the Qwen vocabulary from `--qwen-tiktoken`.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.engine.grammar import GrammarCompiler, GrammarSpec
from tempering.rewards.ruler import judge_schema

# Qwen2's pre-tokenizer pattern (the same as its tokenizer.json)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN_VOCAB = 151936
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def qwen_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def answer(num: int, seed: int) -> str:
    """A valid answer to judge_schema(num), compact JSON."""
    r = random.Random(seed)
    words = ["the", "agent", "reached", "its", "goal", "quickly", "but", "wasted", "two", "steps", "on", "a", "wrong", "tool", "call", "then", "recovered"]
    return json.dumps({"scores": [
        {"trajectory_id": str(i + 1), "explanation": " ".join(r.choice(words) for _ in range(r.randint(5, 25))).capitalize() + ".",
         "score": round(r.random(), 2)} for i in range(num)]})


def vocabularies(args):
    """(name, vocab size, stop ids, llguidance tokenizer, xgrammar TokenizerInfo or None, encode)."""
    import llguidance
    import llguidance.hf
    from rollout import load_cpu_model

    _, hf = load_cpu_model()
    out = []
    start = time.perf_counter()
    ll = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=hf.eos_token_id)
    ll_s = time.perf_counter() - start
    out.append(("smollm2", len(hf), [hf.eos_token_id], ll, ll_s, lambda v: _xgr_hf(hf, v),
                lambda s: hf(s, add_special_tokens=False)["input_ids"]))
    if args.qwen_tiktoken:
        ranks = qwen_ranks(Path(args.qwen_tiktoken))
        start = time.perf_counter()
        ll = llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=QWEN_SPECIALS, pattern=QWEN_PATTERN,
                                                  eos_token=151645, n_vocab=QWEN_VOCAB)
        ll_s = time.perf_counter() - start
        out.append(("qwen2", QWEN_VOCAB, [151645], ll, ll_s, lambda v: _xgr_raw(ranks, v), ll.tokenize_str))
    return out


def _xgr_hf(hf, vocab_size):
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[hf.eos_token_id])


def _xgr_raw(ranks, vocab_size):
    import xgrammar as xgr

    vocab = [b""] * vocab_size
    for token, rank in ranks.items():
        vocab[rank] = token
    for text, i in QWEN_SPECIALS.items():
        vocab[i] = text.encode()
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[151645])


def schemas(k: int) -> list[str]:
    """k distinct RULER-like schemas (cold compiles: no cache can hit)."""
    out = []
    for i in range(k):
        s = judge_schema(8)
        s["properties"]["scores"]["title"] = f"scores {i}"
        out.append(json.dumps(s))
    return out


def bench_llguidance(ll, vocab_size, encode, batch, steps):
    import llguidance
    import llguidance.torch as llt

    compile_s = []
    for text in schemas(5):
        start = time.perf_counter()
        m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS))
        compile_s.append(time.perf_counter() - start)
        assert not m.is_error(), m.get_error()
    executor = llguidance.LLExecutor()
    targets = [encode(answer(8, b)) for b in range(batch)]
    offsets = [(b * 7) % 40 for b in range(batch)]
    matchers = [m.deep_copy() for _ in range(batch)]
    for matcher, t, o in zip(matchers, targets, offsets):
        assert matcher.consume_tokens(t[:o])
    mask = llt.allocate_token_bitmask(batch, vocab_size)
    fill, consume = [], []
    for s in range(steps):
        start = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        fill.append(time.perf_counter() - start)
        pairs = [(m, t[o + s]) for m, t, o in zip(matchers, targets, offsets) if o + s < len(t)]
        for i, (t, o) in enumerate(zip(targets, offsets)):
            if o + s < len(t):
                assert (int(mask[i, t[o + s] // 32]) >> (t[o + s] % 32)) & 1
        start = time.perf_counter()
        assert all(executor.consume_token_par(pairs))
        consume.append(time.perf_counter() - start)
    return _summary(compile_s, fill, consume)


def bench_xgrammar(info, vocab_size, encode, batch, steps):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_s = []
    for text in schemas(5):
        start = time.perf_counter()
        grammar = compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
        xgr.GrammarMatcher(grammar)
        compile_s.append(time.perf_counter() - start)
    batcher = xgr.BatchGrammarMatcher()
    targets = [encode(answer(8, b)) for b in range(batch)]
    offsets = [(b * 7) % 40 for b in range(batch)]
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
    for matcher, t, o in zip(matchers, targets, offsets):
        assert all(matcher.accept_token(tok) for tok in t[:o])
    mask = xgr.allocate_token_bitmask(batch, vocab_size)
    fill, consume = [], []
    for s in range(steps):
        start = time.perf_counter()
        batcher.batch_fill_next_token_bitmask(matchers, mask)
        fill.append(time.perf_counter() - start)
        live = [(m, t[o + s]) for m, t, o in zip(matchers, targets, offsets) if o + s < len(t)]
        start = time.perf_counter()
        batcher.batch_accept_token([m for m, _ in live], [t for _, t in live])
        consume.append(time.perf_counter() - start)
    return _summary(compile_s, fill, consume)


def _summary(compile_s, fill, consume):
    return {"compile_ms": round(statistics.median(compile_s) * 1e3, 2), "fill_ms": round(statistics.median(fill) * 1e3, 3),
            "consume_ms": round(statistics.median(consume) * 1e3, 3)}


def run_libs(args) -> dict:
    try:
        import xgrammar  # noqa: F401

        has_xgrammar = True
    except ImportError:
        has_xgrammar = False
    results = {}
    for name, vocab_size, _, ll, ll_setup_s, xgr_info, encode in vocabularies(args):
        row = {"vocab_size": vocab_size, "llguidance_tokenizer_s": round(ll_setup_s, 2)}
        for batch in args.batch:
            row[f"llguidance_b{batch}"] = bench_llguidance(ll, vocab_size, encode, batch, args.steps)
            if has_xgrammar:
                start = time.perf_counter()
                info = xgr_info(vocab_size)
                row["xgrammar_tokenizer_s"] = round(time.perf_counter() - start, 2)
                row[f"xgrammar_b{batch}"] = bench_xgrammar(info, vocab_size, encode, batch, args.steps)
        results[name] = row
    return {"benchmark": "structured_outputs_libs", "schema": "ruler.judge_schema(8)", "results": results,
            "threads": torch.get_num_threads()}


def run_engine(args) -> dict:
    from rollout import CPU_WORKLOADS, GPU_WORKLOADS, build_gpu_model, load_cpu_model, machine, make_prompts, sync

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    work = (GPU_WORKLOADS if gpu else CPU_WORKLOADS)["R"]  # base weights (rollout.py also runs it with a live LoRA)
    if gpu:
        import llguidance

        if not args.qwen_tiktoken:
            raise SystemExit("--device cuda needs --qwen-tiktoken PATH (the random model has no tokenizer)")
        model, _ = build_gpu_model(device)
        tokenizer = llguidance.LLTokenizer.from_tiktoken(encoder=qwen_ranks(Path(args.qwen_tiktoken)), special_tokens=QWEN_SPECIALS,
                                                         pattern=QWEN_PATTERN, eos_token=151645, n_vocab=QWEN_VOCAB)
        stop, decode_tok = [151645], _NoText()
    else:
        model, tokenizer = load_cpu_model()
        stop, decode_tok = [tokenizer.eos_token_id], tokenizer
    prompts = make_prompts(work["num_prompts"], None if gpu else tokenizer, model.config.vocab_size, seed=0)
    engine = Engine(engine_model_for(model, 4096), decode_tok, stop_token_ids=stop, lock=threading.RLock(),
                    config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, cpu_kv_cache_bytes=1 << 30),
                    max_seq_len=4096)
    compiler = GrammarCompiler(tokenizer, stop_token_ids=stop, vocab_size=model.config.vocab_size)
    start = time.perf_counter()
    grammar = compiler.compile(GrammarSpec.json_schema(judge_schema(32)))
    first_compile_s = time.perf_counter() - start
    free = SamplingParams(max_tokens=work["max_new"], temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=work["max_new"], temperature=1.0, grammar=grammar)

    def timed(params) -> float:
        warm = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, grammar=params.grammar)
        for f in [engine.submit(p, warm, n=work["n"], policy=BasePolicy()) for p in prompts]:
            f.result()
        engine.blocks.forget_cached()
        sync(device)
        start = time.perf_counter()
        results = [f.result() for f in [engine.submit(p, params, n=work["n"], policy=BasePolicy()) for p in prompts]]
        sync(device)
        elapsed = time.perf_counter() - start
        assert all(len(c.token_ids) == work["max_new"] for r in results for c in r)
        return elapsed

    free_s, constrained_s = [], []
    for _ in range(args.rounds):  # interleaved, best of each: a shared machine's load drifts
        free_s.append(timed(free))
        constrained_s.append(timed(constrained))
    engine.close()
    num_tokens = work["num_prompts"] * work["n"] * work["max_new"]
    return {
        "benchmark": "structured_outputs_engine", "device": args.device, "machine": machine(device),
        "workload": f"R: {work['num_prompts']} prompts x n={work['n']}, {work['max_new']} new tokens, schema ruler.judge_schema(32)",
        "first_compile_s": round(first_compile_s, 2),
        "free_tok_per_s": round(num_tokens / min(free_s), 1),
        "json_schema_tok_per_s": round(num_tokens / min(constrained_s), 1),
        "ratio_json_schema_vs_free": round(min(free_s) / min(constrained_s), 3),
        "rounds_s": {"free": [round(t, 2) for t in free_s], "json_schema": [round(t, 2) for t in constrained_s]},
        "torch": torch.__version__,
    }


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _python_work(seconds: float) -> None:
    """Hold the GIL for `seconds` running Python, as the engine thread does while the masks fill."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


def run_threads(args) -> dict:
    import llguidance
    import numpy as np

    if args.qwen_tiktoken:
        ll = llguidance.LLTokenizer.from_tiktoken(encoder=qwen_ranks(Path(args.qwen_tiktoken)), special_tokens=QWEN_SPECIALS,
                                                  pattern=QWEN_PATTERN, eos_token=151645, n_vocab=QWEN_VOCAB)
        name, vocab_size, stop = "qwen2", QWEN_VOCAB, [151645]
    else:
        from rollout import load_cpu_model

        _, hf = load_cpu_model()
        ll, name, vocab_size, stop = hf, "smollm2", len(hf), [hf.eos_token_id]
    from tempering.engine.grammar import MaskWorker

    grammar = GrammarCompiler(ll, stop_token_ids=stop, vocab_size=vocab_size).compile(GrammarSpec.json_schema(judge_schema(32)))
    B, W = args.batch[0], (vocab_size + 31) // 32
    executors = {"default": llguidance.LLExecutor(), **{f"threads_{k}": llguidance.LLExecutor(num_threads=k) for k in (1, 2, 4)}}
    arrangements = [*executors, "per_row_calls", "engine_shards", "engine_shards_busy"]

    shards = grammar.compiler.num_shards
    executors["pool_over_copies"] = llguidance.LLExecutor(num_threads=shards)
    arrangements.insert(len(executors) - 1, "pool_over_copies")

    def one_copy() -> list:  # B matchers of one compiled copy (shard 0), as llguidance's own usage has them
        return [m.inner for m in (grammar.matcher() for _ in range(shards * B)) if m.shard == 0][:B]

    engine_rows = [grammar.matcher() for _ in range(B)]  # spread over the copies, as the engine's are
    worker = MaskWorker()
    pinned = torch.cuda.is_available()  # as the engine allocates the masks on a GPU host
    busy_rows = [grammar.matcher() for _ in range(B)]
    rows = {"engine_shards": engine_rows, "engine_shards_busy": busy_rows}
    matchers = {a: [m.inner for m in rows[a]] if a in rows else one_copy() for a in arrangements}
    # llguidance's pool with as many threads as copies, the rows spread over the copies and sorted
    # by copy (its chunks are contiguous, so each thread mostly works on one copy)
    matchers["pool_over_copies"] = [m.inner for m in sorted((grammar.matcher() for _ in range(B)), key=lambda m: m.shard)]
    masks = {a: torch.empty((B, W), dtype=torch.int32) for a in arrangements}
    tokens: dict[str, list[int] | None] = dict.fromkeys(arrangements)
    times: dict[str, list[float]] = {a: [] for a in arrangements}
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        for a in arrangements:  # interleaved, so that a busy moment of the host hits every arrangement
            ms, ptr, toks = matchers[a], masks[a].data_ptr(), tokens[a]
            start = time.perf_counter()
            if a in rows:  # MaskWorker: one thread per copy of the grammar, as the engine runs it
                pairs = list(zip(rows[a], toks)) if toks is not None else None
                pending = worker.submit(rows[a], pinned=pinned, consume=pairs)
                if a == "engine_shards_busy":  # the engine thread's own Python work of the step, meanwhile:
                    _python_work(args.busy_ms / 3e3)  # processing the tokens and scheduling (a third),
                pending.wait_filling()
                if a == "engine_shards_busy":
                    _python_work(args.busy_ms * 2 / 3e3)  # then preparing the next step
                _, out = pending.result()  # the engine hands this buffer to the device as it is: no host copy
            elif a in executors:
                if toks is not None:
                    executors[a].consume_token_par(list(zip(ms, toks)))
                executors[a].unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], ptr, W * 4, B)
            else:
                for i, m in enumerate(ms):
                    if toks is not None:
                        m.consume_token(toks[i])
                    m.unsafe_compute_mask_ptr(ptr + i * W * 4, W * 4)
            times[a].append(time.perf_counter() - start)
            words = (out if a in rows else masks[a]).numpy()
            bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
            tokens[a] = [int(rng.choice(np.flatnonzero(row))) for row in bits]
    worker.close()
    ms_per_step = {a: round(statistics.median(t[5:]) * 1e3, 3) for a, t in times.items()}
    busy, alone = args.busy_ms, ms_per_step["engine_shards"]
    return {"benchmark": "structured_outputs_threads", "schema": "ruler.judge_schema(32)", "vocab": name, "batch": B,
            "consume_and_fill_ms_per_step": ms_per_step,
            "engine_shards_busy": {"python_work_ms": busy, "ms": ms_per_step["engine_shards_busy"],
                                   "serial_ms": round(busy + alone, 3), "ideal_ms": round(max(busy, alone), 3)},
            "vs_default": {a: round(ms_per_step[a] / ms_per_step["default"], 3) for a in arrangements}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["libs", "engine", "threads"])
    parser.add_argument("--qwen-tiktoken", default=None, help="path to dashscope's resources/qwen.tiktoken")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--busy-ms", type=float, default=2.0,
                        help="threads: the engine thread's Python work during the masks (engine_shards_busy)")
    parser.add_argument("--rounds", type=int, default=3, help="engine: interleaved timed runs of each")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    run = {"libs": run_libs, "engine": run_engine, "threads": run_threads}[args.what]
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()  # run as a script, this folder is on sys.path: rollout.py's helpers import as `rollout`
