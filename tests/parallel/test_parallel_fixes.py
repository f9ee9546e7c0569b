"""Fixes from a review of the launch path, each with a test that failed before it: a closed Driver
left its control listener accepting; a worker that died joining the group gave a store timeout
naming no rank, and left the process unable to start its next run. (The channel's fixes from the
same review are tested in test_channel.py.)"""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from tempering.errors import DistributedError
from tempering.parallel import Driver

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
