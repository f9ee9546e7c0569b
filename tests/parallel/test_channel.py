"""The driver–worker channel over a pipe to a forked worker process: calls in order, generations
with streamed tokens, errors carried back, and a killed worker failing every request at once."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import threading
import time

import pytest

from tempering.errors import ConfigError, DistributedError, EngineError
from tempering.parallel import WorkerLink, serve


class TwoArgumentError(Exception):
    """Pickles, but cannot be unpickled: its __init__ takes two arguments, its args hold one."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


class Handler:
    """A worker's handler: records calls; `submit` streams `n` tokens from a thread."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def record(self, *, value: int, delay_s: float = 0.0) -> list[int]:
        time.sleep(delay_s)
        self.calls.append(value)
        return list(self.calls)

    def bad_config(self) -> None:
        raise ConfigError("lora rank 8 differs from the adapter's 4")

    def unpicklable(self) -> object:
        return threading.Lock()

    def fails_oddly(self) -> None:
        raise TwoArgumentError("/models/x", "no such file")

    def submit(self, *, prompt_ids, n, on_token=None):
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            for i in range(n):
                if on_token is not None:
                    on_token(0, prompt_ids[0] + i, -0.5, [])
            future.set_result([prompt_ids[0] + i for i in range(n)])

        threading.Thread(target=run).start()
        return future


def run_worker(conn) -> None:
    os._exit(0 if serve(conn, Handler(), rank=1) else 1)


@pytest.fixture
def channel():
    driver_end, worker_end = multiprocessing.Pipe()
    worker = multiprocessing.get_context("fork").Process(target=run_worker, args=(worker_end,), daemon=True)
    worker.start()
    worker_end.close()
    failures: list[DistributedError] = []
    link = WorkerLink(1, driver_end, on_failure=failures.append)
    yield link, worker, failures
    if link.error is None:
        link.close(timeout_s=5)
    worker.join(5)


def test_calls_run_in_the_order_sent_and_return_their_results(channel):
    link, *_ = channel
    futures = [link.call("record", value=1, delay_s=0.05), link.call("record", value=2), link.call("record", value=3)]
    assert [f.result(timeout=10) for f in futures] == [[1], [1, 2], [1, 2, 3]]


def test_a_worker_error_comes_back_with_its_type_and_rank(channel):
    link, *_ = channel
    with pytest.raises(ConfigError, match="differs") as info:
        link.call("bad_config").result(timeout=10)
    assert "(raised on worker rank 1)" in info.value.__notes__
    with pytest.raises(DistributedError, match="could not send back its result"):
        link.call("unpicklable").result(timeout=10)
    assert link.call("record", value=4).result(timeout=10) == [4]  # the channel still works


def test_a_generation_streams_its_tokens_then_resolves(channel):
    link, *_ = channel
    tokens = []
    future = link.submit({"prompt_ids": [100], "n": 3}, on_token=lambda *t: tokens.append(t))
    assert future.result(timeout=10) == [100, 101, 102]
    assert [t[1] for t in tokens] == [100, 101, 102]


def test_a_killed_worker_fails_pending_and_later_requests_at_once(channel):
    link, worker, failures = channel
    pending = link.call("record", value=5, delay_s=30.0)
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(DistributedError, match="worker rank 1 .*died"):
        pending.result(timeout=10)
    with pytest.raises(DistributedError):
        link.submit({"prompt_ids": [1], "n": 1}).result(timeout=1)
    assert len(failures) == 1 and failures[0] is link.error


def test_shutdown_ends_the_worker_loop_cleanly(channel):
    link, worker, failures = channel
    link.close(timeout_s=5)
    worker.join(5)
    assert worker.exitcode == 0 and not failures


def test_a_shutdown_with_a_reason_ends_the_worker_at_once_even_during_a_call(channel):
    """After another rank died, a call may be blocked in a collective with it: the worker exits
    without waiting for the call, with code 1."""
    link, worker, failures = channel
    link.call("record", value=6, delay_s=30.0)  # stands for a call blocked in a collective
    start = time.monotonic()
    link.close(timeout_s=10, reason="node 1 (host gpu-b) left this multi-GPU run")
    worker.join(10)
    assert worker.exitcode == 1 and time.monotonic() - start < 5 and not failures


def test_requests_queued_while_the_sender_waits_leave_as_one_batch_in_order(channel):
    link, *_ = channel
    sent, release = [], threading.Event()
    send = link._conn.send

    def slow_send(message):  # the first send stalls, as one waiting for the GIL or the socket
        sent.append(message[0])
        if len(sent) == 1:
            release.wait(10)
        send(message)

    link._conn.send = slow_send
    first = link.call("record", value=0)
    while not sent:
        time.sleep(0.01)
    queued = [link.call("record", value=i) for i in range(1, 21)]
    bad = link.call("record", value=threading.Lock())  # cannot be pickled: fails alone
    after = link.call("record", value=21)
    release.set()
    assert first.result(timeout=10) == [0]
    assert [f.result(timeout=10)[-1] for f in queued] == list(range(1, 21))
    with pytest.raises(DistributedError, match="could not send"):
        bad.result(timeout=10)
    assert after.result(timeout=10) == list(range(22))
    assert sent[:2] == ["call", "batch"]  # the 22 queued requests tried to leave in one message


def test_a_token_callback_that_raises_fails_its_request_alone_and_the_channel_keeps_working(channel):
    link, *_ = channel

    def on_token(*token) -> None:
        raise RuntimeError("Event loop is closed")  # what call_soon_threadsafe raises once the server's loop closed

    with pytest.raises(EngineError, match="token callback raised"):
        link.submit({"prompt_ids": [7], "n": 3}, on_token=on_token).result(timeout=10)
    assert link.call("record", value=1).result(timeout=10) == [1]
    assert link.submit({"prompt_ids": [5], "n": 2}).result(timeout=10) == [5, 6]


def test_a_reply_to_a_request_cancelled_just_before_it_arrives_does_not_stop_the_channel(channel):
    link, *_ = channel

    class CancelledMeanwhile(concurrent.futures.Future):
        """Cancelled by another thread (the server's event loop: its client went away) right as the reply is set."""

        def set_result(self, result) -> None:
            self.cancel()
            super().set_result(result)

    link.call("record", value=0).result(timeout=10)  # request id 0
    racing = CancelledMeanwhile()
    slow = link.call("record", value=1, delay_s=0.5)  # request id 1: its future swapped for one that races its reply
    with link._lock:
        link._pending[1] = (racing, link._pending[1][1])
    assert not slow.done()
    assert link.call("record", value=2).result(timeout=10) == [0, 1, 2]  # the reader thread lived through the race
    assert racing.cancelled()


def test_an_error_the_driver_cannot_unpickle_comes_back_as_a_distributed_error_with_its_text(channel):
    link, *_ = channel
    with pytest.raises(DistributedError, match="could not send back its error.*no such file"):
        link.call("fails_oddly").result(timeout=10)
    assert link.call("record", value=3).result(timeout=10) == [3]
