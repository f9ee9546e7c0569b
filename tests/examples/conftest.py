"""Helpers for the recipes under examples/: run a train.py as a user does, load a module by path."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_module(relative_path: str, name: str):
    """examples/<relative_path> imported under `name` (the recipes' own module names collide)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_recipe(recipe: str, cwd: Path, *args: str) -> str:
    """`python examples/<recipe>/train.py ARGS` in `cwd`; returns stdout (fails the test on a non-zero exit)."""
    env = dict(os.environ, TQDM_DISABLE="1")
    done = subprocess.run([sys.executable, str(EXAMPLES / recipe / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{recipe} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def history(root: Path, project: str, name: str) -> list[dict]:
    path = root / project / "models" / name / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session", autouse=True)
def _default_model_converted(default_model_dir):
    """Convert the default model once, before any recipe's subprocess needs it."""
    return default_model_dir
