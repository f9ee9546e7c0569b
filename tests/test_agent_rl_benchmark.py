"""benchmarks/agent_rl.py on the CPU: multi-turn tool-calling rollouts of the real default model through
the endpoint, and the training step on them (the benchmark's smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).parent.parent / "benchmarks" / "agent_rl.py"


def test_agent_rollouts_are_cached_across_turns_and_train_on_exactly_their_sampled_tokens():
    out = subprocess.run([sys.executable, str(BENCHMARK), "--device", "cpu", "--skip-pipelined"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])["tempering"]
    [gather] = record["gathers"]
    assert gather["requests"] == 2 * 4 * 3 and gather["failed_tool_calls"] == 0  # every forced call parsed
    # what a turn re-sends (the previous prompt and completion) is served from the prefix cache
    assert gather["prefix_cache_hit_resent"] >= 0.9
    assert gather["prompt_tokens_cached"] == gather["engine"]["cached_tokens"]
    train = record["train"]
    assert train["trained_equals_sampled"] and train["turns_merged_into_one_sequence"]
    assert 0 < record["host_share"] < 1
