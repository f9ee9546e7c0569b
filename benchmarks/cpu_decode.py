"""CPU decode steps by batch size: the engine's few-row products as (W x^T)^T against x W^T.

On a CPU, `modeling/precision.linear` takes a float32 product of at most SKINNY_ROWS rows (a decode
step's) as (W x^T)^T, which MKL runs faster than x W^T. This script times the engine on the
default model (float32) with the live rank-8 adapter (the trainer's LoRA, A and B non-zero), one
chat prompt sampled n = 1 / 4 / 8 / 16 / 32 / 64 times for 32 new tokens (EOS ignored), with
SKINNY_ROWS at 64 (the engine's) and at 0 (every product as x W^T), the two alternating in one
process, each twice. Prints one JSON line: ms per decode step for each, and their ratio.

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
from tempering.service.policies import AdapterPolicy  # noqa: E402

NEW_TOKENS = 32


def main() -> None:
    model, tokenizer = load_cpu_model()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a cat."}],
                                           add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    holder = {"peft": None}
    engine = Engine(engine_model_for(model, 2048), tokenizer, stop_token_ids=[], lock=threading.RLock(),
                    config=EngineConfig(), max_seq_len=2048, peft_model=lambda: holder["peft"])
    trainer = add_live_adapter(model)
    holder["peft"] = trainer.peft_model
    policy = AdapterPolicy(trainer.peft_model, "default", 1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    engine.submit(prompt, params, n=4, policy=policy).result()  # warm-up
    runs: dict[int, dict[str, list[float]]] = {}
    try:
        for rnd in range(2):
            for n in (1, 4, 8, 16, 32, 64):
                order = ("skinny", "x_wt") if rnd == 0 else ("x_wt", "skinny")
                for mode in order:
                    precision.SKINNY_ROWS = 64 if mode == "skinny" else 0
                    start = time.perf_counter()
                    engine.submit(prompt, params, n=n, policy=policy).result()
                    ms = (time.perf_counter() - start) / NEW_TOKENS * 1e3
                    runs.setdefault(n, {"skinny": [], "x_wt": []})[mode].append(round(ms, 1))
    finally:
        precision.SKINNY_ROWS = 64
        engine.close()
    record = {"benchmark": "cpu_decode", "machine": machine(torch.device("cpu")), "torch": torch.__version__,
              "model": "SmolLM2-135M-Instruct float32, live LoRA r8", "new_tokens": NEW_TOKENS,
              "ms_per_step": {n: {**r, "x_wt_over_skinny": round(min(r["x_wt"]) / min(r["skinny"]), 2)}
                              for n, r in runs.items()}}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
