"""Running a test's rank script as several processes with torchrun's variables (CPU gloo or GPU NCCL), the
rank scripts' start, and the random training data the data-parallel and tensor-parallel tests share."""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tempering.training import TokenizedSequence

STACK_DUMP_ENV = "TEMPERING_TEST_STACK_DUMP_S"  # a rank writes every thread's stack after this many seconds
NOISE = ("eartbeat", "ProcessGroupNCCL.cpp", "TCPStore.cpp", "frame #")  # NCCL/c10d lines that bury the stacks


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
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               STACK_DUMP_ENV: str(max(5.0, timeout_s - 15))}
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
            lines = [line for line in output.splitlines() if not any(noise in line for noise in NOISE)]
            tails.append(f"---- rank {rank} ----\n" + "\n".join(lines)[-8000:])
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


def start_rank(device_type: str, *, bind_device: bool = False, **init_kwargs: Any) -> tuple[int, torch.device]:
    """In a rank script: join the process group (NCCL on cuda:RANK, gloo on the CPU) with
    `init_process_group`'s `init_kwargs` (`bind_device`: its `device_id` on CUDA, NCCL set up at
    once), one CPU thread, and every thread's stack written on SIGUSR1 (what `run_ranks` sends when
    the ranks time out). Returns (rank, device)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get(STACK_DUMP_ENV):  # and once, unasked, shortly before run_ranks gives up: from a C
        # watchdog thread, which needs no signal handler (a CUDA rank's SIGUSR1 handler was found replaced)
        faulthandler.dump_traceback_later(float(os.environ[STACK_DUMP_ENV]))
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if bind_device:
            init_kwargs["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **init_kwargs)
    return rank, device


def random_sequences(seed: int, n: int, vocab_size: int) -> list[TokenizedSequence]:
    """`n` random RL sequences (12-40 tokens, the last 3-10 trained), groups of 4, mixed-sign advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length, k = rng.randint(12, 40), rng.randint(3, 10)
        out.append(TokenizedSequence(
            [rng.randrange(vocab_size) for _ in range(length)], [False] * (length - k) + [True] * k,
            [float("nan")] * (length - k) + [rng.uniform(-3, -0.5) for _ in range(k)],
            advantage=rng.choice([-1.0, -0.5, 0.5, 1.0]), group_index=i // 4, trajectory_index=i % 4,
        ))
    return out
