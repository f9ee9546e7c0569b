"""Running a test's rank script as several processes with torchrun's variables (CPU gloo or GPU NCCL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, scenario: str, out: Path, *, device: str = "cpu", world_size: int = 2,
              timeout_s: float = 120) -> list[dict]:
    """Run `script SCENARIO OUT DEVICE` as `world_size` processes; each writes OUT/rank{r}.pt, returned in rank order."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), scenario, str(out), device], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        # every thread's stack (the rank scripts register faulthandler on SIGUSR1), then each rank's output
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        tails = []
        for rank, p in enumerate(procs):
            if rank < len(logs):  # finished (or died) before the others timed out: its output is read
                output = f"(exited with {p.returncode})\n{logs[rank]}"
            else:
                try:
                    output = p.communicate(timeout=5)[0]
                except subprocess.TimeoutExpired:
                    p.kill()
                    output = p.communicate()[0]
            tails.append(f"---- rank {rank} ----\n{output[-4000:]}")
        pytest.fail(f"the ranks of {scenario!r} did not finish within {timeout_s} s (a hang):\n" + "\n".join(tails))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for rank in range(world_size):
        path = out / f"rank{rank}.pt"
        assert path.is_file(), f"rank {rank} wrote no result:\n{logs[rank][-3000:]}"
        results.append(torch.load(path, weights_only=False))
    return results
