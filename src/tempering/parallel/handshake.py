"""The driver's side of the start-up handshake: accepting the workers' control connections.

Each worker connects to the driver's control listener (launch.py publishes its address in the
store) and says hello: ("hello", rank, pid, node, host). `accept_workers` takes the connections
on a thread of its own while it watches the processes it started, so that a worker that dies
before its hello is named with its exit code, and a connection that breaks in its handshake
(or a stranger's) does not stop the accepting.
"""

from __future__ import annotations

import logging
import queue
import signal
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Connection, Listener

from ..errors import DistributedError
from .channel import keep_alive

__all__ = ["accept_workers"]

log = logging.getLogger("tempering")

# how often the driver looks whether a worker that hung up has exited
WATCH_S = 0.05
# how long the driver waits for the exit code of a worker that hung up before saying which rank it is
EXIT_GRACE_S = 2.0


def accept_workers(listener: Listener, count: int, procs: dict[int, subprocess.Popen],
            timeout_s: float) -> dict[int, tuple[Connection, int, int, str]]:
    """The workers' (connection, pid, node, host) by rank, watching their processes (those
    started here) while waiting."""
    arrivals: queue.Queue = queue.Queue()
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()
            except (EOFError, ConnectionError) as exc:  # the peer hung up in the handshake
                if stop.is_set():
                    return  # `_wake`'s connection
                # a worker that died as it connected, or a stranger: the next one must still be accepted
                log.warning("a connection to the control listener broke in its handshake: %r", exc)
                continue
            except OSError:
                return  # the listener was closed
            except Exception as exc:  # a wrong key (AuthenticationError): not one of ours
                log.warning("refused a connection to the control listener: %r", exc)
                continue
            arrivals.put(conn)

    thread = threading.Thread(target=accept, name="tempering-accept", daemon=True)
    thread.start()
    try:
        return _receive_hellos(arrivals, count, procs, timeout_s)
    finally:
        # closing a listening socket does not wake a thread blocked in its accept() (Linux): that
        # thread, and the socket it holds open and still accepting on, would outlive the run
        stop.set()
        _wake(listener)
        thread.join(5.0)


def _wake(listener: Listener) -> None:
    """Connect to `listener` and hang up at once: its accept() fails (the handshake finds no peer)."""
    host, port = listener.address
    try:
        socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "") else host, port), timeout=5.0).close()
    except OSError as exc:
        log.debug("could not wake the control listener's accepting thread: %r", exc)


def _receive_hellos(arrivals: queue.Queue, count: int, procs: dict[int, subprocess.Popen],
                    timeout_s: float) -> dict[int, tuple[Connection, int, int, str]]:
    conns: dict[int, tuple[Connection, int, int, str]] = {}
    deadline = time.monotonic() + timeout_s
    while len(conns) < count:
        try:
            conn = arrivals.get(timeout=0.2)
        except queue.Empty:
            for rank, proc in procs.items():
                if proc.poll() is not None and rank not in conns:
                    raise _exited_starting(rank, proc.returncode) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, count + 1)) - set(conns))
                raise DistributedError(
                    f"workers {missing} did not connect within {timeout_s:.0f} s; in a run over several machines, "
                    "check that every node's torchrun started and that the nodes can open TCP connections to each "
                    "other on any port (the control channel and NCCL take free ones)") from None
            continue
        try:
            # a worker says hello as soon as it is connected; one that does not is waited for until the deadline
            hello = conn.recv() if conn.poll(max(0.0, deadline - time.monotonic())) else None
        except (EOFError, OSError):
            conn.close()
            raise _hung_up(procs, set(conns)) from None
        if hello is None or len(hello) != 5 or hello[0] != "hello" or hello[1] in conns:
            conn.close()
            continue
        keep_alive(conn)
        conns[hello[1]] = (conn, *hello[2:])  # hello: ("hello", rank, pid, node, host)
    return conns


def _exited_starting(rank: int, code: int) -> DistributedError:
    how = f"code {code}"
    if code < 0:
        try:
            how += f" ({signal.Signals(-code).name})"
        except ValueError:  # a real-time signal has no name
            pass
    return DistributedError(f"worker rank {rank} exited with {how} while starting, before it joined the run; see its "
                            "output above (the workers started here write to this process's stdout and stderr)")


def _hung_up(procs: dict[int, subprocess.Popen], ranks_in: set[int]) -> DistributedError:
    """The error for a worker that connected and hung up before its hello: it names the worker by its
    process, when that was started here and exits within EXIT_GRACE_S."""
    waiting = {rank: proc for rank, proc in procs.items() if rank not in ranks_in}
    deadline = time.monotonic() + EXIT_GRACE_S
    while True:
        for rank, proc in waiting.items():
            if proc.poll() is not None:
                return _exited_starting(rank, proc.returncode)
        if not waiting or time.monotonic() > deadline:
            return DistributedError("a worker connected to the driver's control channel and hung up before saying "
                                    "which rank it is: it died while starting; see the workers' output (above, or "
                                    "torchrun's on each node)")
        time.sleep(WATCH_S)
