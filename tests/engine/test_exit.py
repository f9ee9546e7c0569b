"""A script that ends while its engine is sampling exits cleanly (ART-style code never closes its backend)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import threading, time
    import torch, transformers
    from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    engine = Engine(engine_model_for(transformers.LlamaForCausalLM(config).eval(), 4096), Tok(), stop_token_ids=[0],
                    lock=threading.RLock(), config=EngineConfig(num_kv_blocks=512, block_size=16), max_seq_len=4096)
    future = engine.submit([1, 2, 3], SamplingParams(max_tokens=4000, ignore_eos=True), n=8, policy=BasePolicy())
    time.sleep(1.0)
    print("exiting while sampling", flush=True)
""")


def test_a_script_that_ends_while_the_engine_samples_exits_with_code_0():
    """Without the engine's atexit close, the interpreter stopped the worker thread inside a torch
    call and the process aborted ("terminate called without an active exception", code 134) in 4
    runs of 4."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exiting while sampling" in done.stdout
