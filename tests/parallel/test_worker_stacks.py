"""A worker rank that hangs can be asked where: SIGUSR1 prints every thread's stack."""

import datetime
import os
import signal
import subprocess
import time

import torch.distributed as dist

from tempering.service.worker import worker_command


def test_a_waiting_worker_prints_its_stacks_on_sigusr1(tmp_path):
    # the driver's store, which never publishes its channel: the worker waits in its rendezvous
    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        worker = subprocess.Popen(worker_command("cpu", 60.0), env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigusr1(worker.pid) and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # importing torch; the handler is set just before the rendezvous
        worker.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while "join" not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert worker.poll() is None  # the dump does not stop it
    finally:
        worker.kill()
        worker.wait()
    text = err.read_text()
    assert "thread" in text and "in join" in text, text[-2000:]


def _catches_sigusr1(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGUSR1 (Linux: SigCgt in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGUSR1 - 1) & 1)
