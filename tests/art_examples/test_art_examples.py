"""ART's own example code, run as a user runs it (`python script.py`), one training step each.

Each example runs in its own process, in a temporary directory (its `./.tempering` goes there),
on the default model, offline. The copies in this folder differ from ART's files only in the
lines marked `# tempering: was ...` (see each file's header).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_example(script: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("OPENPIPE_", "WANDB_", "BACKUP_"))}
    environment.update(env, TQDM_DISABLE="1")
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=540, check=False)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def history(cwd: Path, project: str, name: str) -> list[dict]:
    path = cwd / ".tempering" / project / "models" / name / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def checkpoint(cwd: Path, project: str, name: str, step: int) -> Path:
    return cwd / ".tempering" / project / "models" / name / "checkpoints" / f"{step:04d}"


def test_tic_tac_toe_rollout_and_game_code_train_one_step(tmp_path):
    done = run_example(HERE / "tic_tac_toe" / "train_one_step.py", tmp_path)
    result = json.loads(done.stdout.split("RESULT ", 1)[1].split(" is_adapter_unchanged")[0])
    assert result["step"] == 1 and result["num_groups"] == 1
    assert (checkpoint(tmp_path, "tic-tac-toe", "tic-tac-toe-001", 1) / "adapter_model.safetensors").is_file()
    (row,) = history(tmp_path, "tic-tac-toe", "tic-tac-toe-001")
    assert row["train/num_trajectories"] + row["train/exception_rate"] * 4 == pytest.approx(4)
    if result["num_groups_trainable"] == 0:  # ART's utils.py parses JSON moves; the prompt asks for XML
        assert "none of the 1 groups has reward spread" in done.stderr


def test_yes_no_maybe_trains_one_step_with_its_internal_config(tmp_path):
    done = run_example(HERE / "yes_no_maybe" / "yes-no-maybe.py", tmp_path,
                       BASE_MODEL="SmolLM2-135M-Instruct", NUM_STEPS="1")
    assert "ArtOptionWarning" in done.stderr and "tinker_args" in done.stderr
    assert (checkpoint(tmp_path, "yes-no-maybe", "012", 1) / "adapter_config.json").is_file()
    (row,) = history(tmp_path, "yes-no-maybe", "012")
    assert row["train/num_trajectories"] == 96 and row["data/step_num_groups_submitted"] == 48


def test_temporal_clue_trains_one_step_with_backend_train_and_logs_val(tmp_path):
    run_example(HERE / "temporal_clue" / "temporal-clue.py", tmp_path)
    rows = history(tmp_path, "temporal-clue", "001")
    val = [r for r in rows if "val/reward" in r]
    train = [r for r in rows if "data/step_num_groups_submitted" in r]
    assert len(val) == 1 and val[0]["val/num_trajectories"] == 128
    # backend.train logs nothing, as ART's: the script's model.log(..., step=result.step) is the one row
    assert [r["step"] for r in rows if "train/reward" in r] == [1]
    assert train and train[0]["train/num_trajectories"] == 16
    # the puzzles are made so that groups have reward spread: the step really updates the adapter
    assert train[0]["data/step_num_groups_trainable"] >= 1 and "loss/grad_norm" in train[0]
    assert (checkpoint(tmp_path, "temporal-clue", "001", 1) / "adapter_model.safetensors").is_file()
