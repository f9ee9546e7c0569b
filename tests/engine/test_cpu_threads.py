"""Heavy CPU calls in a thread of their own: their OpenMP pool ends with them (engine/cpu_threads.py)."""

from __future__ import annotations

import contextvars
import os
import threading
import time

import pytest
import torch

from tempering.engine.cpu_threads import run_in_own_thread
from tempering.service.hub import ModelHub

needs_threads = pytest.mark.skipif(
    torch.cuda.is_available() or torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"),
    reason="a CPU-only Linux machine with torch on two threads or more")
REQUEST = contextvars.ContextVar("REQUEST", default=None)


def parallel_op() -> None:
    torch.ones(1 << 22).mul_(2)  # 4M elements: above torch's grain size, a parallel region


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def steady_os_threads() -> int:
    """The process's thread count once it holds for 50 ms (exiting workers take a moment)."""
    count = os_threads()
    for _ in range(40):
        time.sleep(0.05)
        if (now := os_threads()) == count:
            break
        count = now
    return count


def os_threads_down_to(limit: int, timeout_s: float = 2.0) -> int:
    """The process's thread count once at most `limit`, or at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (count := os_threads()) > limit and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the call runs in the caller's thread")
def test_the_call_runs_in_another_thread_with_the_callers_context_and_returns_or_raises():
    REQUEST.set("r1")
    seen = run_in_own_thread(lambda x, *, y: (threading.get_ident(), REQUEST.get(), x + y), 1, y=2)
    assert seen[0] != threading.get_ident() and seen[1:] == ("r1", 3)

    def fail():
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        run_in_own_thread(fail)


@needs_threads
def test_a_parallel_op_in_a_long_lived_thread_keeps_a_pool_but_run_in_own_thread_does_not():
    run_in_own_thread(parallel_op)  # libgomp's first pool of the process, and its one-off set-up
    before = steady_os_threads()
    run_in_own_thread(parallel_op)
    assert os_threads_down_to(before) <= before  # the call's thread and its workers are gone

    done = threading.Event()
    ran = threading.Event()
    holder = threading.Thread(target=lambda: (parallel_op(), ran.set(), done.wait()), daemon=True)
    holder.start()
    ran.wait()
    try:  # what a thread that ran a training step and lived on kept: its own workers
        assert os_threads() >= before + 2
    finally:
        done.set()
        holder.join()


@needs_threads
def test_a_training_call_leaves_no_pool_on_the_hubs_training_thread(tmp_path):
    hub = ModelHub(tmp_path, device="cpu")
    try:
        hub.submit_training(lambda: None).result()  # the training thread exists from here on
        before = steady_os_threads()
        ident = hub.submit_training(lambda: (parallel_op(), threading.get_ident())[1]).result()
        assert ident not in {t.ident for t in threading.enumerate()}
        assert os_threads_down_to(before) <= before
    finally:
        hub.close()
