"""Fixes from reviews of the launch path, each with a test that failed before it: a closed Driver
left its control listener accepting; a worker that died joining the group gave a store timeout
naming no rank, and left the process unable to start its next run; a worker that died before its hello gave a bare EOFError; a connection that hung up
in its handshake stopped the listener accepting; a worker command that could not be started left the
listener open and the workers started before it running. (The channel's fixes from the first review
are tested in test_channel.py.)"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import pytest

from tempering.errors import DistributedError
from tempering.parallel import Driver, launch

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


DIES_BEFORE_ITS_HELLO = """
import os
from tempering.parallel import launch
launch.keep_alive = lambda conn: os._exit(5)  # a worker that died connected, before its hello
launch.join(device_type="cpu", timeout_s=60, start_timeout_s=60)
"""


def test_a_worker_that_dies_before_its_hello_is_named_with_its_exit_code():
    with pytest.raises(DistributedError, match=r"worker rank 1 exited with code 5 while starting, before it joined "
                                               r"the run; see its output above"):
        Driver.start(2, device_type="cpu", command=[sys.executable, "-c", DIES_BEFORE_ITS_HELLO], timeout_s=60,
                     start_timeout_s=60)


HANGS_UP_THEN_JOINS = WORKER.replace("from tempering.parallel import join, serve", """
import socket
from tempering.parallel import launch, serve
def client(address, authkey, real=launch.Client):
    socket.create_connection(address).close()  # a peer that hangs up before the handshake, as a dying worker
    return real(address, authkey=authkey)
launch.Client = client
join = launch.join""")


def test_a_connection_that_hangs_up_in_its_handshake_leaves_the_listener_accepting_the_workers():
    driver = Driver.start(2, device_type="cpu", command=[sys.executable, "-c", HANGS_UP_THEN_JOINS], timeout_s=60,
                          start_timeout_s=20)
    driver.close(timeout_s=30)
    assert [link.process.returncode for link in driver.links] == [0]


def test_a_worker_that_cannot_be_started_leaves_no_listener_open_and_no_worker_running(monkeypatch):
    addresses: list[tuple[str, int]] = []
    procs: list[subprocess.Popen] = []

    def listener(*args, real=launch.Listener, **kwargs):
        made = real(*args, **kwargs)
        addresses.append(made.address)
        return made

    def popen(args, real=subprocess.Popen, **kwargs):  # rank 1 starts; rank 2's executable does not exist
        procs.append(real(["/nonexistent/tempering-worker"] if procs else args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(launch, "Listener", listener)
    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        with pytest.raises(DistributedError, match=r"could not start worker rank 2 .*No such file"):
            Driver.start(3, device_type="cpu", command=[sys.executable, "-c", "import time; time.sleep(60)"],
                         timeout_s=60, start_timeout_s=60)
        assert [proc.returncode for proc in procs] == [-signal.SIGKILL]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(addresses[0], timeout=5).close()
    finally:
        for proc in procs:  # what the old code left running
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("command", [[], "python worker.py"])
def test_an_empty_or_string_worker_command_is_refused_before_anything_starts(command):
    before = set(threading.enumerate())
    with pytest.raises(DistributedError, match="non-empty argv list"):
        Driver.start(2, device_type="cpu", command=command, timeout_s=5, start_timeout_s=5)
    assert [t for t in threading.enumerate() if t not in before] == []
