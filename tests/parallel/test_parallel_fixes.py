"""Fixes from a review of the multi-process paths, each with a test that failed before it: the driver's
end of a worker channel stopped reading after a token callback raised or a reply raced a
cancellation, and never answered an error that cannot be unpickled; a closed Driver left its control
listener accepting; a worker that died joining the group gave a store timeout naming no rank, and
left the process unable to start its next run."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import socket
import sys
import threading
import time

import pytest

from tempering.errors import DistributedError, EngineError
from tempering.parallel import Driver, WorkerLink, serve


class TwoArgumentError(Exception):
    """Pickles, but cannot be unpickled: its __init__ takes two arguments, its args hold one."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


class Handler:
    def echo(self, *, value: int, delay_s: float = 0.0) -> int:
        time.sleep(delay_s)
        return value

    def fails_oddly(self) -> None:
        raise TwoArgumentError("/models/x", "no such file")

    def submit(self, *, value: int, n: int, on_token=None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            for i in range(n):
                if on_token is not None:
                    on_token(0, value + i, -0.5, [])
            future.set_result(value)

        threading.Thread(target=run).start()
        return future


def run_worker(conn) -> None:
    os._exit(0 if serve(conn, Handler(), rank=1) else 1)


@pytest.fixture
def link():
    driver_end, worker_end = multiprocessing.Pipe()
    worker = multiprocessing.get_context("fork").Process(target=run_worker, args=(worker_end,), daemon=True)
    worker.start()
    worker_end.close()
    link = WorkerLink(1, driver_end)
    yield link
    if link.error is None:
        link.close(timeout_s=5)
    worker.join(5)
    if worker.is_alive():
        worker.kill()


def test_a_token_callback_that_raises_fails_its_request_alone_and_the_channel_keeps_working(link):
    def on_token(*token) -> None:
        raise RuntimeError("Event loop is closed")  # what call_soon_threadsafe raises once the server's loop closed

    with pytest.raises(EngineError, match="token callback raised"):
        link.submit({"value": 7, "n": 3}, on_token=on_token).result(timeout=10)
    assert link.call("echo", value=1).result(timeout=10) == 1
    assert link.submit({"value": 5, "n": 2}).result(timeout=10) == 5


def test_a_reply_to_a_request_cancelled_just_before_it_arrives_does_not_stop_the_channel(link):
    class CancelledMeanwhile(concurrent.futures.Future):
        """Cancelled by another thread (the server's event loop: its client went away) right as the reply is set."""

        def set_result(self, result) -> None:
            self.cancel()
            super().set_result(result)

    link.call("echo", value=0).result(timeout=10)  # request id 0
    racing = CancelledMeanwhile()
    slow = link.call("echo", value=1, delay_s=0.5)  # request id 1: its future swapped for one that races its reply
    with link._lock:
        link._pending[1] = (racing, link._pending[1][1])
    assert not slow.done()
    assert link.call("echo", value=2).result(timeout=10) == 2  # the reader thread lived through the race
    assert racing.cancelled()


def test_an_error_the_driver_cannot_unpickle_comes_back_as_a_distributed_error_with_its_text(link):
    with pytest.raises(DistributedError, match="could not send back its error.*no such file"):
        link.call("fails_oddly").result(timeout=10)
    assert link.call("echo", value=3).result(timeout=10) == 3


WORKER = """
import torch.distributed as dist
from tempering.parallel import join, serve
info, conn, store = join(device_type="cpu", timeout_s=60, start_timeout_s=60)
serve(conn, object(), rank=info.rank)
dist.destroy_process_group()
"""


def test_a_closed_driver_leaves_no_thread_accepting_on_its_control_listener():
    before = set(threading.enumerate())
    driver = Driver.start(2, device_type="cpu", command=[sys.executable, "-c", WORKER], timeout_s=60,
                          start_timeout_s=60)
    address = driver._listener.address
    driver.close(timeout_s=30)
    assert [link.process.returncode for link in driver.links] == [0]
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5).close()


DIES_IN_ITS_INIT = """
import os
from tempering.parallel import launch
launch._init_group = lambda *args: os._exit(3)  # a worker whose init_process_group failed, after its hello
launch.join(device_type="cpu", timeout_s=60, start_timeout_s=60)
"""


def test_a_worker_that_dies_joining_the_group_is_named_and_the_next_run_of_the_process_starts():
    before = set(threading.enumerate())
    with pytest.raises(DistributedError, match=r"worker rank 1 \(pid \d+\) .*died: it exited with code 3"):
        Driver.start(2, device_type="cpu", command=[sys.executable, "-c", DIES_IN_ITS_INIT], timeout_s=2,
                     start_timeout_s=60)
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == []
    # and this process starts its next run (its failed init must not leave torch's group count advanced)
    driver = Driver.start(2, device_type="cpu", command=[sys.executable, "-c", WORKER], timeout_s=10,
                          start_timeout_s=60)
    driver.close(timeout_s=30)
    assert [link.process.returncode for link in driver.links] == [0]
