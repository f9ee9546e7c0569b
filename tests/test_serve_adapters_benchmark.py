"""benchmarks/serve_adapters.py on the CPU, tiny: four adapters mixed in one batch and one alone from an
inference-only server, then a trainable model's rollouts and step (the benchmark's smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).parent.parent / "benchmarks" / "serve_adapters.py"


def test_the_serving_benchmark_runs_every_mode_and_prints_one_json_line():
    out = subprocess.run([sys.executable, str(BENCHMARK), "--device", "cpu", "--rounds", "1"],
                         capture_output=True, text=True, timeout=900, cwd=BENCHMARK.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(record["tok_s"]) == {"base", "one_adapter", "four_adapters_mixed"} and all(record["tok_s"].values())
    assert record["mixed_vs_one_adapter"] > 0 and record["trainable_live_adapter_tok_s"] > 0
    assert record["peak_gib"] == {"inference_only": None, "trainable": None}  # GPU memory: measured on a GPU only
