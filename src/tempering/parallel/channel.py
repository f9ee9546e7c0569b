"""The control channel between the driver (rank 0) and each worker process.

Tensors that every rank must agree on (gradients, the adapter) travel through torch.distributed
collectives. What is addressed to one rank travels here: commands ("register this model",
"take this training step") and generation requests with their results. A channel is an
authenticated `multiprocessing.connection` socket carrying pickled tuples:

    driver → worker   ("call", id, method, kwargs)    run in arrival order on the worker's call thread
                      ("submit", id, kwargs, stream)  a generation, answered when it completes
                      ("abort", id)                   stop that generation (its client went away); it
                                                      is answered with RequestAborted, as on one GPU
                      ("shutdown",)                   exit cleanly
                      ("shutdown", reason)            the run failed elsewhere: exit at once
                      ("batch", [message, ...])       several of the above in order: what was
                                                      queued while the driver's sender thread waited
    worker → driver   ("done", id, result) | ("error", id, exception)
                      ("token", id, sample_index, token_id, logprob, top)   streamed tokens

Calls run one at a time, in order, on every worker, so that collective operations inside them
(a training step) happen in the same order on every rank. Generations run beside them.

A channel that breaks (its worker died) fails every pending and later request of it with
DistributedError at once; the driver never waits on a dead worker. TCP keepalives (`keep_alive`)
break a channel whose peer machine went silent (powered off, unplugged) within about a minute.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import pickle
import queue
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..errors import DistributedError, EngineError, RequestAborted

__all__ = ["WorkerLink", "keep_alive", "serve", "settle"]

log = logging.getLogger("tempering")

TokenCallback = Callable[[int, int, float, list], None]

# a silent peer breaks the channel after KEEPALIVE_IDLE_S + KEEPALIVE_COUNT x KEEPALIVE_INTERVAL_S
# (25 s), or when data it was sent stays unacknowledged for USER_TIMEOUT_MS (60 s)
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, USER_TIMEOUT_MS = 10, 5, 3, 60_000

RUN_LOST = "Every rank holds part of each training step and one engine replica, so the run cannot go on;"


def keep_alive(conn: Connection) -> None:
    """Turn on TCP keepalives (and, on Linux, a timeout for unacknowledged data) on a channel's
    socket: without them, a read from a machine that lost power or network waits forever."""
    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a duplicate of the descriptor
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                              ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
            if hasattr(socket, option):  # Linux names; macOS has only some
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    finally:
        sock.close()


class WorkerLink:
    """The driver's end of one worker's channel.

    Args:
        rank: the worker's rank.
        conn: the connection to it.
        process: the worker process, when the driver started it (for its exit code in errors).
        pid: the worker's process id, as it reported when it joined (on its own machine).
        node: the worker's node (torchrun's GROUP_RANK) when the run spans several machines,
            else None; with `host`, its hostname, it is named in errors.
        on_failure: called once, from the reader thread, with the DistributedError when the
            channel breaks (not after `close`).
    """

    def __init__(self, rank: int, conn: Connection, *, process: subprocess.Popen | None = None,
                 pid: int | None = None, node: int | None = None, host: str = "",
                 on_failure: Callable[[DistributedError], None] | None = None) -> None:
        self.rank = rank
        self.process = process
        self.pid = pid if pid is not None else (process.pid if process is not None else None)
        self.node = node
        self.host = host
        self._conn = conn
        self._on_failure = on_failure
        self._ids = itertools.count()
        self._pending: dict[int, tuple[concurrent.futures.Future, TokenCallback | None]] = {}
        self._lock = threading.Lock()  # guards _pending, _error, _outbox and _closing
        self._queued = threading.Condition(self._lock)
        self._outbox: list[tuple] = []  # messages for the sender thread, in order
        self._error: DistributedError | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read, name=f"tempering-link-{rank}", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_queued, name=f"tempering-link-{rank}-send", daemon=True)
        self._sender.start()

    @property
    def error(self) -> DistributedError | None:
        """Why the channel broke, or None while it works."""
        return self._error

    def call(self, method: str, **kwargs: Any) -> concurrent.futures.Future:
        """Run `method(**kwargs)` on the worker's call thread (after the calls sent before it);
        a Future of its result. Fails with DistributedError if the worker is gone."""
        return self._send(lambda i: ("call", i, method, kwargs), None)

    def submit(self, kwargs: dict[str, Any], on_token: TokenCallback | None = None) -> concurrent.futures.Future:
        """A generation on the worker (its handler's `submit(**kwargs)`); `on_token` receives its
        streamed tokens on the reader thread. A Future of the completions."""
        return self._send(lambda i: ("submit", i, kwargs, on_token is not None), on_token)

    def abort(self, future: concurrent.futures.Future) -> bool:
        """Stop the generation behind `future` (from `submit`) on the worker, which then answers it
        with RequestAborted. False if `future` is not a pending request of this link."""
        with self._lock:
            request_id = next((i for i, (f, _) in self._pending.items() if f is future), None)
            if request_id is None or self._error is not None or self._closing:
                return False
            self._outbox.append(("abort", request_id))  # after its "submit", if that is still queued
            self._queued.notify()
        return True

    def _send(self, message: Callable[[int], tuple], on_token: TokenCallback | None) -> concurrent.futures.Future:
        """Queue the message for the sender thread: the caller (often the server's event loop)
        neither pickles nor writes to the socket, and requests queued while the sender waited
        for the GIL leave in one write."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
                return future
            if self._closing:
                future.set_exception(DistributedError(f"worker rank {self.rank} is shutting down"))
                return future
            request_id = next(self._ids)
            self._pending[request_id] = (future, on_token)
            self._outbox.append(message(request_id))
            self._queued.notify()
        return future

    def _send_queued(self) -> None:
        """The sender thread: everything queued so far in one message ("batch", [...]), until a
        shutdown message has been sent or the channel broke."""
        while True:
            with self._lock:
                while not self._outbox:
                    self._queued.wait()
                messages, self._outbox = self._outbox, []
            try:
                self._conn.send(messages[0] if len(messages) == 1 else ("batch", messages))
            except (OSError, ValueError) as exc:  # broken pipe: the reader reports the worker's fate
                self._fail_sent(messages, exc)
            except Exception:  # one of them cannot be pickled: send them one by one, fail only it
                for message in messages:
                    try:
                        self._conn.send(message)
                    except Exception as exc:
                        self._fail_sent([message], exc)
            if messages[-1][0] == "shutdown":
                return

    def _fail_sent(self, messages: list[tuple], exc: Exception) -> None:
        error = DistributedError(f"could not send to worker rank {self.rank}: {type(exc).__name__}: {exc}")
        with self._lock:
            entries = [self._pending.pop(m[1], None) for m in messages if m[0] in ("call", "submit")]
        for entry in entries:
            if entry is not None:
                settle(entry[0], exception=error)

    @property
    def where(self) -> str:
        """"node 1 (host gpu-b)" in a run over several machines, else ""."""
        return f"node {self.node} (host {self.host})" if self.node is not None else ""

    def close(self, timeout_s: float = 30.0, reason: str | None = None) -> None:
        """Ask the worker to exit and wait up to `timeout_s` for it; then kill it (if started here).
        With a `reason` (the run failed), the worker exits at once, logging it, with code 1."""
        self.request_shutdown(reason)
        if self.process is not None:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("worker rank %d did not exit within %.0f s; killing it", self.rank, timeout_s)
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout_s)
        self._sender.join(timeout_s)
        self._conn.close()

    def request_shutdown(self, reason: str | None = None) -> None:
        """Ask the worker to exit, without waiting (`close` waits); see `close` for `reason`."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._outbox.append(("shutdown",) if reason is None else ("shutdown", reason))  # after what is queued
            self._queued.notify()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # a reply that cannot be read (serve checks errors): keep the channel
                log.error("worker rank %d sent a message that cannot be read: %r", self.rank, exc)
                continue
            kind, request_id = message[0], message[1]
            if kind == "token":
                entry = self._pending.get(request_id)
                if entry is not None and entry[1] is not None:
                    try:
                        entry[1](*message[2:])
                    except Exception as exc:  # this request's streaming failed: stop it alone, as the engine does
                        log.warning("a request's token callback raised %r; that request is stopped", exc)
                        with self._lock:
                            entry = self._pending.pop(request_id, None)
                        if entry is not None:
                            settle(entry[0], exception=EngineError(f"the request's token callback raised {exc!r}"))
                continue
            with self._lock:
                entry = self._pending.pop(request_id, None)
            if entry is None:
                continue
            # a reply to a request cancelled here (its client went away), even between a check and the
            # set, is dropped: an InvalidStateError would end this thread and every later reply with it
            if kind == "done":
                settle(entry[0], result=message[2])
            else:
                settle(entry[0], exception=message[2])
        self._fail(DistributedError(self._death_reason()))

    def _death_reason(self) -> str:
        if self._closing:
            return f"worker rank {self.rank} was shut down"
        code = None
        if self.process is not None:
            try:
                code = self.process.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        how = "its connection to the driver broke"
        if code is not None:
            how = f"it exited with code {code}"
            if code < 0:
                how += f" ({signal.Signals(-code).name})"
        elif self.node is not None:
            how += " (the process, its machine, or the network to it went down)"
        place = f"pid {self.pid}" if self.pid is not None else ""
        if self.node is not None:
            place += f" on node {self.node}, host {self.host}"
        if self.node is None:
            what_next = "see the worker's output above, then start the server (or the LocalBackend) again"
        else:
            what_next = f"see torchrun's output on {self.where}, then start torchrun again on every node"
        return (f"worker rank {self.rank}{f' ({place.strip()})' if place else ''} of this multi-GPU run died: {how}. "
                f"{RUN_LOST} {what_next}: it resumes from the last checkpoint")

    def _fail(self, error: DistributedError) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            settle(future, exception=error)
        if not self._closing and self._on_failure is not None:
            self._on_failure(error)


def serve(conn: Connection, handler: Any, *, rank: int) -> bool:
    """Serve the driver on a worker: run its calls on `handler` and its generations through
    `handler.submit(**kwargs, on_token=...)` (which returns a concurrent Future; "abort" calls
    `handler.abort(future)`), until it sends
    "shutdown" (returns True), stops the run because it failed elsewhere, or goes away (both
    logged; returns False: exit at once, as a call may be blocked in a collective with a dead rank).

    Exceptions are sent back to the driver, which raises them there; one that cannot be pickled
    is sent as a DistributedError with its text.
    """
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        try:
            payload = pickle.dumps(message)
            if message[0] == "error":  # an exception whose __init__ takes other arguments pickles but cannot
                pickle.loads(payload)  # be read back: the driver could not tell which request failed
        except Exception as exc:  # the driver must hear back about every request, also then
            if message[0] == "token":
                return
            what = "result" if message[0] == "done" else f"error {message[2]!r:.1000}"
            payload = pickle.dumps(("error", message[1], DistributedError(
                f"worker rank {rank} could not send back its {what}: {type(exc).__name__}: {exc}")))
        with send_lock:
            try:
                conn.send_bytes(payload)
            except (OSError, ValueError):
                pass  # the driver is gone: the receive loop ends

    running: dict[int, concurrent.futures.Future] = {}  # the generations not yet answered, for "abort"

    def reply(request_id: int, future: concurrent.futures.Future) -> None:
        running.pop(request_id, None)
        if future.cancelled():  # aborted before the engine admitted it
            send(("error", request_id, _noted(RequestAborted("the request was aborted before it started"), rank)))
            return
        exc = future.exception()
        send(("error", request_id, _noted(exc, rank)) if exc is not None else ("done", request_id, future.result()))

    calls: queue.Queue = queue.Queue()

    def run_calls() -> None:
        while (item := calls.get()) is not None:
            request_id, method, kwargs = item
            try:
                result = getattr(handler, method)(**kwargs)
            except Exception as exc:
                send(("error", request_id, _noted(exc, rank)))
            else:
                send(("done", request_id, result))

    # a daemon: a call blocked in a collective with a dead rank must not keep the process alive
    threading.Thread(target=run_calls, name="tempering-calls", daemon=True).start()
    def handle(message: tuple) -> bool | None:
        """One message; True/False when it ends the serving (see above), else None."""
        kind = message[0]
        if kind == "shutdown":
            if len(message) > 1:
                log.error("the driver stops the run: %s", message[1])
                return False
            calls.put(None)
            return True
        if kind == "call":
            calls.put(message[1:])
        elif kind == "submit":
            request_id, kwargs, stream = message[1:]
            on_token = (lambda *token, i=request_id: send(("token", i, *token))) if stream else None
            try:
                future = handler.submit(**kwargs, on_token=on_token)
            except Exception as exc:
                send(("error", request_id, _noted(exc, rank)))
                return None
            running[request_id] = future
            future.add_done_callback(lambda f, i=request_id: reply(i, f))
        elif kind == "abort":
            future = running.get(message[1])
            if future is not None:
                handler.abort(future)
        return None

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            log.error("the driver (rank 0) went away")
            return False
        for one in message[1] if message[0] == "batch" else [message]:
            if (done := handle(one)) is not None:
                return done


def settle(future: concurrent.futures.Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve `future` with `exception`, or else `result`, unless it is done already (cancelled by its
    caller, on another thread, at any moment)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _noted(exc: BaseException, rank: int) -> BaseException:
    exc.add_note(f"(raised on worker rank {rank})")
    return exc
