"""A run over two machines, as two torchrun "nodes" on this host (c10d rendezvous): on CPUs, one
gloo process each; on GPUs (skipped with fewer than two), NCCL processes: two each with four GPUs, else one each.
`tempering serve` across them answers and trains (on CPUs: as one process does), and a node
killed in the middle of a training step stops the run with a DistributedError that names it.
Also, on forked workers: the error of a node that loses several ranks names all of them; the
control channel's sockets carry TCP keepalives; LocalBackend(gpus=N) refuses to run inside torchrun.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

import tempering as art
from tempering.errors import DistributedError
from tempering.parallel import Driver, RankInfo, WorkerLink, serve
from tempering.parallel.channel import KEEPALIVE_IDLE_S, keep_alive

ENGINE = {"cpu_kv_cache_bytes": 16 << 20, "max_num_seqs": 32}
GPU_ENGINE = {"num_kv_blocks": 2048, "max_num_seqs": 32}
PROMPTS = ["Say a number.", "Name a color.", "Pick a letter.", "Tell me a story."]
KEY = "nodes-test-key"
# processes per node: on GPUs two each where there are four, else one each
PER_NODE = {"cpu": 1, "cuda": max(1, min(2, torch.cuda.device_count() // 2))}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                reason="needs two GPUs"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(root: Path, http_port: int, logs: Path, device: str) -> list[subprocess.Popen]:
    """Two torchrun agents of one c10d rendezvous, each starting `tempering serve` processes: one
    on the CPU, or on GPUs one each (GPUs 0 and 1) or two each (GPUs 0-1 and 2-3).

    Each "machine" has an address of its own (127.0.0.2, 127.0.0.3: torchrun numbers the nodes in
    the order of their addresses), and the first hosts the rendezvous, so that node 1 holds
    neither rank 0 nor the store, as on two machines where the first serves.
    """
    rdzv = f"127.0.0.2:{free_port()}"
    per_node = PER_NODE[device]
    agents = []
    for i in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "nodes-test",
                   "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", f"127.0.0.{2 + i}",
                   "--monitor-interval", "0.2", "-m", "tempering.cli", "serve", "--device", device,
                   "--port", str(http_port), "--root", str(root),
                   "--engine-config", json.dumps(ENGINE if device == "cpu" else GPU_ENGINE)]
        env = {**os.environ, "TEMPERING_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
        if device == "cuda":  # NCCL_HOSTID: NCCL treats the two as machines apart (its network transport between them)
            env.update(CUDA_VISIBLE_DEVICES=",".join(str(per_node * i + k) for k in range(per_node)),
                       NCCL_HOSTID=f"nodes-test-{i}")
        with open(logs / f"agent{i}.log", "w") as log:
            agents.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    return agents


def workers_of(agent: subprocess.Popen) -> list[int]:
    """The pids of the processes an agent started (each in a session of its own)."""
    return [int(pid) for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()]


def signal_node(agent: subprocess.Popen, workers: list[int], signum: int) -> None:
    """`signum` to every process of a "machine": its torchrun agent and the processes it started."""
    for pid in [agent.pid, *workers]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def worker_env(pid: int) -> dict[str, str]:
    """torchrun's variables of a process it started."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


async def wait_until_serving(base_url: str, agents: list[subprocess.Popen], logs: Path, within_s: float = 90) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient() as client:
        while True:
            for i, agent in enumerate(agents):
                assert agent.poll() is None, (logs / f"agent{i}.log").read_text()[-3000:]
            try:
                response = await client.get(f"{base_url}/models", headers={"Authorization": f"Bearer {KEY}"})
                if response.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the two-node server did not come up"
            await asyncio.sleep(0.3)


async def rollouts(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    client = model.openai_client()

    async def group(prompt: str) -> art.TrajectoryGroup:
        messages = [{"role": "user", "content": prompt}]
        completion = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, n=4,
                                                          temperature=1.0)
        return art.TrajectoryGroup([
            art.Trajectory(messages_and_choices=[*messages, choice], reward=sum(choice.sampled_logprobs))
            for choice in completion.choices])

    return list(await asyncio.gather(*[group(p) for p in PROMPTS[:3]]))


async def greedy(model: art.TrainableModel) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and logprobs for every prompt, sent at once (spread over the replicas)."""
    client = model.openai_client()

    async def one(prompt: str):
        completion = await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0.0)
        choice = completion.choices[0]
        return list(choice.token_ids), list(choice.sampled_logprobs)

    return list(await asyncio.gather(*[one(p) for p in PROMPTS * 2]))


async def job(backend, base_model: str, groups: list[art.TrajectoryGroup] | None = None) -> dict:
    """Greedy answers, one training step on `groups` (sampled here if None), greedy answers again."""
    model = art.TrainableModel(name="tiny", project="nodes", base_model=base_model)
    await model.register(backend)
    seen: dict = {"model": model, "before": await greedy(model)}
    seen["groups"] = groups if groups is not None else await rollouts(model)
    await model.train(seen["groups"], config=art.TrainConfig(learning_rate=5e-2))
    seen["after"], seen["step"] = await greedy(model), await model.get_step()
    return seen


@pytest.fixture(scope="module", params=DEVICES)
def two_nodes(request, tiny_model_dir, tmp_path_factory):
    """The job on two nodes, then node 1 frozen during a training step and killed; what happened."""
    tmp = tmp_path_factory.mktemp("nodes")
    http_port = free_port()
    base_url = f"http://127.0.0.1:{http_port}/v1"
    agents = start_nodes(tmp / "root", http_port, tmp, request.param)
    workers: list[list[int]] = []

    async def run() -> dict:
        await wait_until_serving(base_url, agents, tmp)
        workers.extend(workers_of(agent) for agent in agents)
        backend = art.RemoteBackend(base_url.removesuffix("/v1"), KEY, max_retries=0)
        seen = await job(backend, str(tiny_model_dir))
        seen["device"], seen["node_1"] = request.param, {int(worker_env(pid)["RANK"]): pid for pid in workers[1]}
        seen["worker_env"] = worker_env(workers[1][0])
        signal_node(agents[1], workers[1], signal.SIGSTOP)  # the machine freezes: rank 0 waits in a collective
        step = asyncio.ensure_future(seen["model"].train(seen["groups"], config=art.TrainConfig(learning_rate=1e-3)))
        await asyncio.sleep(1.5)
        seen["blocked"] = not step.done()
        signal_node(agents[1], workers[1], signal.SIGKILL)  # and dies
        killed = time.monotonic()
        try:
            await asyncio.wait_for(step, 60)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to check
            seen["step_error"] = exc
        await asyncio.to_thread(agents[0].wait, 60)
        seen["stopped_after_s"] = time.monotonic() - killed
        seen["driver_exit"] = agents[0].returncode
        seen["driver_log"] = (tmp / "agent0.log").read_text()
        await backend.close()
        return seen

    try:
        yield asyncio.run(run())
    finally:
        for agent, pids in zip(agents, workers or [[], []]):
            if agent.poll() is None:
                signal_node(agent, pids, signal.SIGKILL)
                agent.wait()


def test_a_two_node_server_serves_and_trains_as_one_process_does(two_nodes, tiny_model_dir, tmp_path):
    per_node, device = PER_NODE[two_nodes["device"]], two_nodes["device"]
    env = two_nodes["worker_env"]  # a process of node 1, reaching rank 0 (its store, its channel) at node 0's address
    assert (env["GROUP_RANK"], env["MASTER_ADDR"], env["LOCAL_WORLD_SIZE"]) == ("1", "127.0.0.2", str(per_node))
    assert sorted(two_nodes["node_1"]) == list(range(per_node, 2 * per_node))
    processes = f"{2 * per_node} GPUs" if device == "cuda" else "2 CPU processes"
    assert f"on {processes} of 2 nodes" in two_nodes["driver_log"]
    assert two_nodes["step"] == 1
    change = max(abs(a - b) for (_, x), (_, y) in zip(two_nodes["before"], two_nodes["after"]) for a, b in zip(x, y))
    assert change > 1e-2  # the step moved the policy
    if device == "cuda":  # bf16 greedy decoding of a random model depends on what shares the batch: no reference
        return

    async def one_process():
        async with art.LocalBackend(path=tmp_path, device="cpu", engine_config=ENGINE) as backend:
            return await job(backend, str(tiny_model_dir), groups=two_nodes["groups"])

    alone = asyncio.run(one_process())
    assert alone["step"] == 1
    for stage, tol in (("before", 1e-5), ("after", 1e-3)):  # after: a data-parallel step, up to Adam's rounding
        for (ids, logprobs), (ids_1, logprobs_1) in zip(two_nodes[stage], alone[stage], strict=True):
            assert ids == ids_1
            assert max(abs(a - b) for a, b in zip(logprobs, logprobs_1)) < tol, stage


def test_a_node_killed_during_a_step_stops_the_run_with_an_error_naming_it(two_nodes):
    assert two_nodes["blocked"]  # the step waited for the frozen node
    ranks = two_nodes["node_1"]  # rank -> pid
    named = [f"worker rank {rank} (pid {pid} on node 1, host " for rank, pid in ranks.items()]
    assert any(text in str(two_nodes.get("step_error")) for text in named), repr(two_nodes.get("step_error"))
    log = two_nodes["driver_log"]
    if len(ranks) == 1:
        assert f"tempering serve stopped: {named[0]}" in log, log[-3000:]
    else:  # the node and all of its ranks in one error
        listed = ", ".join(f"{rank} (pid {pid})" for rank, pid in sorted(ranks.items()))
        node = f"node 1 (host {socket.gethostname()})"
        assert f"tempering serve stopped: {node} left this multi-GPU run" in log, log[-3000:]
        assert f"its worker ranks {listed} to the driver broke" in log
    assert "see torchrun's output on node 1 (host " in log and "start torchrun again on every node" in log
    assert two_nodes["driver_exit"] != 0 and two_nodes["stopped_after_s"] < 30


# ---- the driver's side, on forked workers ------------------------------------------------------


def run_worker(conn) -> None:
    os._exit(0 if serve(conn, object(), rank=0) else 1)


def test_a_node_that_loses_several_ranks_is_named_with_all_of_them():
    """Ranks 1 and 2 on node 1: both killed, the driver's error names the node and both ranks."""
    context = multiprocessing.get_context("fork")
    links, workers = [], []
    for rank in (1, 2):
        driver_end, worker_end = multiprocessing.Pipe()
        worker = context.Process(target=run_worker, args=(worker_end,), daemon=True)
        worker.start()
        worker_end.close()
        workers.append(worker)
        links.append(WorkerLink(rank, driver_end, pid=worker.pid, node=1, host="gpu-b"))
    info = RankInfo(0, 3, 0, torch.device("cpu"), 1, 0, "gpu-a")
    store = dist.HashStore()
    driver = Driver(info, links, Listener(("127.0.0.1", 0), authkey=b"k"), store)
    assert driver.nodes == [0, 1]
    failures: list[DistributedError] = []
    driver.on_failure(failures.append)
    for worker in workers:
        os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(failures) == 1 and failures[0] is driver.error
    message = str(driver.error)
    assert message.startswith("node 1 (host gpu-b) left this multi-GPU run")
    assert f"ranks 1 (pid {workers[0].pid}), 2 (pid {workers[1].pid})" in message
    assert "start torchrun again on every node" in message
    driver.close(timeout_s=5)


def test_the_control_channel_detects_a_silent_machine_with_tcp_keepalives():
    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:
        accepted: list = []
        accepting = threading.Thread(target=lambda: accepted.append(listener.accept()))
        accepting.start()
        with Client(listener.address, authkey=b"k") as client:
            accepting.join(10)
            keep_alive(client)
            with socket.fromfd(client.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                if hasattr(socket, "TCP_KEEPIDLE"):
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
        accepted[0].close()


def test_local_backend_on_several_gpus_is_refused_in_a_process_of_torchrun(tmp_path, monkeypatch):
    """It would start a second run of its own beside torchrun's on every rank."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(art.errors.ConfigError, match="start `tempering serve` under torchrun on every node"):
        art.LocalBackend(path=tmp_path, device="cpu", gpus=2)
