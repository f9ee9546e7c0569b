"""CPU decode steps by batch size, as the engine runs them, against two baselines.

The engine's few-row products on a CPU: `modeling/precision.linear` takes a float32 product of at
most SKINNY_ROWS rows (a decode step's) as (W x^T)^T, one row padded to two, which MKL runs
faster than x W^T; and `engine/cpu_threads.py` keeps tempering's other heavy calls from holding an
OpenMP pool of their own, beside which libgomp makes the engine's workers sleep between
products. This script loads the default model (float32) with the live rank-8 adapter (the
trainer's LoRA, A and B non-zero) off the main thread, as a backend does, and times one chat
prompt sampled n = 1 / 2 / 4 / 8 / 16 / 32 / 64 times for 32 new tokens (EOS ignored) three ways,
alternating in one process, each twice:

- `engine`: as the engine runs;
- `x_wt`: every product as x W^T (SKINNY_ROWS = 0);
- `beside_pool`: as `engine`, while another thread holds an OpenMP pool (as a training thread
  that had run a step did, before `cpu_threads`).

Prints one JSON line: ms per decode step for each, and each baseline's ratio to `engine`.

    python benchmarks/cpu_decode.py
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import add_live_adapter, load_cpu_model, machine  # noqa: E402

import tempering.modeling.precision as precision  # noqa: E402
from tempering.engine import Engine, EngineConfig, SamplingParams, engine_model_for  # noqa: E402
from tempering.engine.cpu_threads import run_in_own_thread  # noqa: E402
from tempering.service.policies import AdapterPolicy  # noqa: E402

NEW_TOKENS = 32


class PoolHolder:
    """A thread that runs one parallel torch op (so libgomp gives it a pool of workers) and then
    waits, keeping the pool, until `release`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        ready = threading.Event()

        def hold() -> None:
            torch.ones(1 << 22).mul_(2)  # 4M elements: above torch's grain size, so a parallel region
            ready.set()
            self._done.wait()

        self._thread = threading.Thread(target=hold, daemon=True)
        self._thread.start()
        ready.wait()

    def release(self) -> None:
        self._done.set()
        self._thread.join()


def setup():
    model, tokenizer = load_cpu_model()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a cat."}],
                                           add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    holder = {"peft": None}
    engine = Engine(engine_model_for(model, 2048), tokenizer, stop_token_ids=[], lock=threading.RLock(),
                    config=EngineConfig(), max_seq_len=2048, peft_model=lambda: holder["peft"])
    trainer = add_live_adapter(model)
    holder["peft"] = trainer.peft_model
    return engine, prompt, AdapterPolicy(trainer.peft_model, "default", 1)


def main() -> None:
    engine, prompt, policy = run_in_own_thread(setup)  # the main thread keeps no OpenMP pool
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    engine.submit(prompt, params, n=4, policy=policy).result()  # warm-up
    modes = ("engine", "x_wt", "beside_pool")
    runs: dict[int, dict[str, list[float]]] = {}
    try:
        for rnd in range(2):
            for n in (1, 2, 4, 8, 16, 32, 64):
                for mode in (modes if rnd == 0 else modes[::-1]):
                    precision.SKINNY_ROWS = 0 if mode == "x_wt" else 64
                    pool = PoolHolder() if mode == "beside_pool" else None
                    start = time.perf_counter()
                    engine.submit(prompt, params, n=n, policy=policy).result()
                    ms = (time.perf_counter() - start) / NEW_TOKENS * 1e3
                    if pool is not None:
                        pool.release()
                    runs.setdefault(n, {m: [] for m in modes})[mode].append(round(ms, 1))
    finally:
        precision.SKINNY_ROWS = 64
        engine.close()
    record = {"benchmark": "cpu_decode", "machine": machine(torch.device("cpu")), "torch": torch.__version__,
              "model": "SmolLM2-135M-Instruct float32, live LoRA r8", "new_tokens": NEW_TOKENS,
              "ms_per_step": {n: {**r, **{f"{m}_over_engine": round(min(r[m]) / min(r["engine"]), 2) for m in modes[1:]}}
                              for n, r in runs.items()}}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
