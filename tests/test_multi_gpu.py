"""The multi-GPU path on two CPU processes (gloo): LocalBackend(gpus=2) and `tempering serve --gpus 2`;
the backend tests also on two GPUs (NCCL) where there are two (skipped otherwise).

A tiny random Llama with the default model's tokenizer keeps each process quick. What is checked:
requests spread over both engine replicas, a training step reaches both (their greedy logprobs
agree before and after it, and change with it), the checkpoint is written once, a new backend
resumes from it on both ranks, and a killed worker stops the server with a DistributedError
instead of a hang, as does a registration that fails on rank 0 alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import tempering as art
from tempering.engine import EngineConfig, SamplingParams
from tempering.engine.grammar import GrammarSpec
from tempering.errors import DistributedError

ENGINE = EngineConfig(cpu_kv_cache_bytes=16 << 20, max_num_seqs=32)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"))]
PROMPTS = ["Say a number.", "Name a color.", "Pick a letter."]


def backend(path: Path, device: str) -> art.LocalBackend:
    if device == "cpu":
        return art.LocalBackend(path=path, device="cpu", gpus=2, engine_config=ENGINE)
    return art.LocalBackend(path=path, gpus=2, engine_config=EngineConfig(num_kv_blocks=2048, max_num_seqs=32))


async def groups_from_rollouts(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    client = model.openai_client()

    async def group(prompt: str) -> art.TrajectoryGroup:
        messages = [{"role": "user", "content": prompt}]
        completion = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, n=4,
                                                          temperature=1.0)
        trajectories = []
        for choice in completion.choices:
            logprobs = list(choice.sampled_logprobs)
            trajectories.append(art.Trajectory(messages_and_choices=[*messages, choice],
                                               reward=math.exp(sum(logprobs) / len(logprobs))))
        return art.TrajectoryGroup(trajectories)

    return list(await asyncio.gather(*[group(p) for p in PROMPTS]))


def replica_probes(service) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and logprobs of one prompt on each replica: rank 0's engine, then rank 1's."""
    prompt = service.renderer.render_prompt([{"role": "user", "content": "Tell me a story."}])
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    futures = [service._submit_local(prompt, greedy, n=1, step=None, on_token=None),
               service._submit_remote(service.workers[0], prompt, greedy, n=1, step=None, on_token=None)]
    return [(f.result(60)[0].token_ids, f.result(60)[0].logprobs) for f in futures]


def assert_same(a, b, tol=1e-5):
    assert a[0] == b[0]
    assert max(abs(x - y) for x, y in zip(a[1], b[1])) < tol


@pytest.fixture(scope="module", params=DEVICES)
def trained(request, tiny_model_dir, tmp_path_factory):
    """One step on two processes; what the test functions check, gathered while the backend ran."""
    path = tmp_path_factory.mktemp("store")
    device = request.param

    async def run() -> dict:
        b = backend(path, device)
        try:
            model = art.TrainableModel(name="tiny", project="mgpu", base_model=str(tiny_model_dir))
            await model.register(b)
            service = b.hub.service("tiny")
            seen: dict = {"before": replica_probes(service)}
            groups = await groups_from_rollouts(model)
            seen["requests_per_replica"] = list(service.router.num_requests)
            seen["result"] = await model.train(groups, config=art.TrainConfig(learning_rate=5e-2))
            seen["after"] = replica_probes(service)
            seen["step"] = await model.get_step()
            # on rank 1's replica: a grammar (compiled there) and a saved step (loaded there)
            prompt = service.renderer.render_prompt([{"role": "user", "content": "Pick."}])
            choice = service.grammars.compile(GrammarSpec.choice(["red apple", "blue sky"]))
            link = service.workers[0]
            constrained = service._submit_remote(link, prompt, SamplingParams(max_tokens=12, grammar=choice), n=3,
                                                 step=None, on_token=None)
            seen["constrained"] = [c.text for c in constrained.result(60)]
            streamed: list = []
            sampled = service._submit_remote(link, prompt, SamplingParams(max_tokens=7, ignore_eos=True), n=2, step=None,
                                             on_token=lambda *token: streamed.append(token))
            seen["streamed"] = (streamed, [(c.token_ids, c.logprobs) for c in sampled.result(60)])
            greedy = SamplingParams(max_tokens=6, temperature=0.0)
            seen["saved_steps"] = [f.result(60)[0].logprobs for f in (
                service._submit_remote(link, prompt, greedy, n=1, step=0, on_token=None),
                service._submit_remote(link, prompt, greedy, n=1, step=1, on_token=None),
                service._submit_local(prompt, greedy, n=1, step=None, on_token=None))]
            # aborted on rank 1 (their clients went away): a running request, and one prepared on a
            # helper thread there (a saved step); rank 1's engine stops them (RequestAborted)
            long = SamplingParams(max_tokens=900, ignore_eos=True)
            futures = [service._submit_remote(link, prompt, long, n=2, step=step, on_token=None) for step in (None, 0)]
            time.sleep(0.3)
            for future in futures:
                service.abort(future)
            seen["aborted"] = [type(f.exception(60)).__name__ for f in futures]
            seen["after_abort"] = service._submit_remote(link, prompt, greedy, n=1, step=None, on_token=None).result(60)
            return seen
        finally:
            await b.close()

    return asyncio.run(run()), path, device


def test_a_request_aborted_on_rank_1_is_stopped_there(trained):
    seen, _, _ = trained
    assert seen["aborted"] == ["RequestAborted", "RequestAborted"]
    assert len(seen["after_abort"][0].token_ids) == 6  # the replica goes on serving


def test_requests_are_served_by_both_processes(trained):
    seen, _, _ = trained
    assert len(seen["requests_per_replica"]) == 2 and min(seen["requests_per_replica"]) >= 1


def test_a_training_step_reaches_the_engine_replicas_of_both_processes(trained):
    seen, path, _ = trained
    assert seen["step"] == 1 and seen["result"].metrics["loss/grad_norm"] > 0
    rank0_before, rank1_before = seen["before"]
    rank0_after, rank1_after = seen["after"]
    assert_same(rank0_before, rank1_before)
    assert_same(rank0_after, rank1_after)
    assert max(abs(x - y) for x, y in zip(rank0_before[1], rank0_after[1])) > 1e-3  # the step changed the policy
    checkpoints = path / "mgpu" / "models" / "tiny" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0001"]  # written once, no temporary left


def test_rank_1_serves_grammars_saved_steps_and_streams_too(trained):
    seen, _, _ = trained
    streamed, completions = seen["streamed"]
    for i, (ids, logprobs) in enumerate(completions):  # every token arrived, in order, before the result
        assert [(t[1], t[2]) for t in streamed if t[0] == i] == list(zip(ids, logprobs))
    assert seen["constrained"] and all(text in ("red apple", "blue sky") for text in seen["constrained"])
    step_0, step_1, live = seen["saved_steps"]  # step 1's checkpoint, loaded on rank 1, is the live policy
    assert max(abs(a - b) for a, b in zip(step_1, live)) < 1e-5
    assert max(abs(a - b) for a, b in zip(step_0, live)) > 1e-3  # the base model is not


def test_a_new_two_process_backend_resumes_from_the_checkpoint_on_both_ranks(trained, tiny_model_dir):
    seen, path, device = trained

    async def run():
        b = backend(path, device)
        try:
            model = art.TrainableModel(name="tiny", project="mgpu", base_model=str(tiny_model_dir))
            await model.register(b)
            assert await model.get_step() == 1
            probes = replica_probes(b.hub.service("tiny"))
            await model.train(await groups_from_rollouts(model), config=art.TrainConfig(learning_rate=5e-2))
            return probes, await model.get_step()
        finally:
            await b.close()

    (rank0, rank1), step = asyncio.run(run())
    assert_same(rank0, seen["after"][0])
    assert_same(rank1, seen["after"][1])
    assert step == 2


DEDICATED = {"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}


@pytest.fixture(scope="module", params=DEVICES)
def dedicated(request, tiny_model_dir, tmp_path_factory):
    """Dedicated mode (ART's trainer/inference GPU ids): rank 0 trains, rank 1 serves; two steps."""
    path = tmp_path_factory.mktemp("dedicated")

    async def run() -> dict:
        # on CPU as ART code does it: a plain LocalBackend(), which starts the worker at registration
        b = art.LocalBackend(path=path, device="cpu", engine_config=ENGINE) if request.param == "cpu" else backend(path, "cuda")
        try:
            model = art.TrainableModel(name="tiny-dedicated", project="mgpu", base_model=str(tiny_model_dir),
                                       _internal_config=DEDICATED)
            await model.register(b)
            service = b.hub.service("tiny-dedicated")
            link = service.workers[0]
            prompt = service.renderer.render_prompt([{"role": "user", "content": "Tell me a story."}])
            greedy = SamplingParams(max_tokens=6, temperature=0.0)

            def on_rank_1(step=None):
                completion = service._submit_remote(link, prompt, greedy, n=1, step=step, on_token=None).result(60)[0]
                return completion.logprobs, completion.policy_versions

            seen: dict = {"before": on_rank_1(), "rank_0_before": replica_probes(service)[0][1]}
            for step in (1, 2):
                groups = await groups_from_rollouts(model)
                # rows of 64 tokens: step 2 has several micro-batches for rank 1 to share (step 1 cannot be
                # shared: rank 1 gets the adapter after it)
                config = art.TrainConfig(learning_rate=5e-2, micro_batch_tokens=64)
                seen[f"result_{step}"] = await model.train(groups, config=config)
                seen[f"live_{step}"] = on_rank_1()
                seen[f"saved_{step}"] = on_rank_1(step=step)
            seen["requests_per_replica"] = list(service.router.num_requests)
            seen["rank_0_after"] = service._submit_local(prompt, greedy, n=1, step=None, on_token=None).result(60)[0].logprobs
            seen["step"] = await model.get_step()
            return seen
        finally:
            await b.close()

    return asyncio.run(run()), path


def test_dedicated_mode_serves_from_rank_1_only_and_trains_on_rank_0(dedicated):
    seen, path = dedicated
    assert seen["requests_per_replica"] == [6]  # one replica (rank 1): 3 groups x 2 steps
    assert seen["step"] == 2 and seen["result_2"].metrics["loss/grad_norm"] > 0
    # the second step was offered to rank 1 (work sharing), which computed the rows it claimed while idle
    assert "data/step_micro_batches" not in seen["result_1"].metrics
    assert seen["result_2"].metrics["data/step_micro_batches"] >= 2
    checkpoints = path / "mgpu" / "models" / "tiny-dedicated" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0001", "0002"]


def test_dedicated_mode_broadcasts_each_step_to_the_serving_rank(dedicated):
    seen, _ = dedicated
    before, versions_before = seen["before"]
    assert max(abs(a - b) for a, b in zip(before, seen["rank_0_before"])) < 1e-5  # the same base on both ranks
    assert set(versions_before) == {0}
    for step in (1, 2):
        live, versions = seen[f"live_{step}"]
        saved, _ = seen[f"saved_{step}"]  # the checkpoint rank 0 wrote, loaded from disk on rank 1
        assert set(versions) == {step}  # rank 1 stamps the received step's version
        assert max(abs(a - b) for a, b in zip(live, saved)) < 1e-5  # what it serves is that step's adapter
    assert max(abs(a - b) for a, b in zip(before, seen["live_1"][0])) > 1e-3  # and the steps changed it
    assert max(abs(a - b) for a, b in zip(seen["live_1"][0], seen["live_2"][0])) > 1e-3
    # rank 0's own engine serves nothing, but reads the same live adapter as its trainer
    assert max(abs(a - b) for a, b in zip(seen["rank_0_after"], seen["live_2"][0])) < 1e-5


def test_dedicated_mode_needs_the_gpus_it_names(tmp_path, tiny_model_dir):
    with pytest.raises(art.errors.ConfigError, match="gpus=N"):
        art.LocalBackend(path=tmp_path, device="cpu", dedicated=True)
    with pytest.raises(art.errors.ConfigError, match="inference_gpu_ids"):
        art.TrainableModel(name="m", project="p", base_model="x", _internal_config={"trainer_gpu_ids": [0]})
    with pytest.raises(art.errors.UnsupportedOptionError, match="trainer_gpu_ids=\\[0\\]"):
        art.TrainableModel(name="m", project="p", base_model="x",
                           _internal_config={"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [2]})

    async def run():
        async with backend(tmp_path, "cpu") as b:  # two processes; the model asks for three
            model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir),
                                       _internal_config={"trainer_gpu_ids": [0], "inference_gpu_ids": [1, 2]})
            with pytest.raises(art.errors.ConfigError, match="LocalBackend\\(gpus=3\\)"):
                await model.register(b)
            assert not (tmp_path / "p" / "models" / "m" / "model.json").exists()

    asyncio.run(run())


async def server_stops(base_url: str, *, within_s: float, seen: list | None = None) -> bool:
    """Whether the server stops answering within `within_s` (it shuts down gracefully). `seen`
    collects (time, status, client port) of the answers that came, for a failure message."""
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                response = await client.get(f"{base_url}/models", timeout=2)
            except httpx.TransportError:
                return True
            if seen is not None:
                stream = response.extensions.get("network_stream")
                try:  # which connection answered: a kept-alive one or a new one
                    port = stream.get_extra_info("client_addr")[1] if stream is not None else None
                except (OSError, TypeError):  # closed already
                    port = None
                seen.append((round(time.monotonic(), 2), response.status_code, port))
            await asyncio.sleep(0.2)
    return False


def uvicorn_state(server) -> str:
    """What uvicorn is doing, for the failure message of a server that does not stop: whether it
    still listens, its open connections and their requests, and the stack of each of its tasks."""
    srv = server._server
    lines = [f"listening={[s.is_serving() for s in getattr(srv, 'servers', [])]} "
             f"connections={len(srv.server_state.connections)} tasks={len(srv.server_state.tasks)} "
             f"force_exit={srv.force_exit}"]
    for conn in list(srv.server_state.connections):
        cycle = getattr(conn, "cycle", None)
        lines.append(f"connection {getattr(conn, 'client', None)}: request "
                     f"{getattr(cycle, 'scope', {}).get('path') if cycle else None}, "
                     f"response complete={getattr(cycle, 'response_complete', None)}")
    try:
        for task in asyncio.all_tasks(srv.servers[0].get_loop()):
            buffer = io.StringIO()
            task.print_stack(file=buffer)
            lines.append(buffer.getvalue())
    except Exception as exc:  # noqa: BLE001 - a diagnostic: say why it is missing
        lines.append(f"no task stacks: {exc!r}")
    return "\n".join(lines)


@pytest.mark.parametrize("device", DEVICES)
def test_a_worker_killed_during_a_step_fails_it_and_stops_the_backend_with_a_clear_error(device, tiny_model_dir,
                                                                                         tmp_path):
    async def run():
        b = backend(tmp_path, device)
        try:
            model = art.TrainableModel(name="tiny", project="mgpu", base_model=str(tiny_model_dir))
            await model.register(b)
            groups = await groups_from_rollouts(model)
            service = b.hub.service("tiny")
            prompt = service.renderer.render_prompt([{"role": "user", "content": "Go on forever."}])
            long = service._submit_remote(service.workers[0], prompt, SamplingParams(max_tokens=900, ignore_eos=True),
                                          n=4, step=None, on_token=None)
            base_url = b.base_url
            worker = service.workers[0].process
            os.kill(worker.pid, signal.SIGSTOP)  # frozen: rank 0's step waits for it in a collective
            step = asyncio.ensure_future(model.train(groups, config=art.TrainConfig(learning_rate=1e-3)))
            await asyncio.sleep(2)
            assert not step.done()
            os.kill(worker.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(DistributedError, match=r"worker rank 1 \(pid \d+\).*SIGKILL"):
                await asyncio.wait_for(step, 60)
            with pytest.raises(DistributedError, match="rank 1"):
                long.result(30)
            with pytest.raises(DistributedError, match="rank 1"):  # and every later call
                await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
            elapsed = time.monotonic() - start
            server, seen = b._server, []  # what a failure here needs to say (about 1 run in 30, cause not found)
            assert await server_stops(base_url, within_s=15, seen=seen), (
                f"the server still answers: backend failure set={b._failure is not None}, server thread alive="
                f"{server._thread.is_alive()}, should_exit={server._server.should_exit}, driver error={b._driver.error!r}, "
                f"last answers (time, status, client port)={seen[-6:]}\n{uvicorn_state(server)}")
            return elapsed
        finally:
            await b.close()

    assert asyncio.run(run()) < 30


def test_a_registration_that_fails_on_rank_0_alone_stops_the_run_instead_of_hanging(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """Rank 0's load fails (on four H100s: out of memory, the 72B shape resumed while the first
    backend's weights were still referenced) and the worker of its tensor-parallel engine waits for
    it in the engine's first all-reduce: registration raises a DistributedError naming rank 0's
    error and the waiting rank, and the backend closes, instead of waiting forever."""
    from tempering.service import hub

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (injected on rank 0)")

    monkeypatch.setattr(hub, "ModelService", out_of_memory)  # this process is rank 0; the worker loads for real
    monkeypatch.setattr(hub, "PEER_GRACE_S", 1.0)

    async def run():
        b = art.LocalBackend(path=tmp_path, device="cpu", gpus=2,
                             engine_config=dataclasses.replace(ENGINE, tensor_parallel_size=2))
        try:
            model = art.TrainableModel(name="tiny", project="mgpu", base_model=str(tiny_model_dir))
            start = time.monotonic()
            with pytest.raises(DistributedError, match=r"failed on rank 0 \(RuntimeError: CUDA out of memory "
                                                       r"\(injected on rank 0\)\) while rank\(s\) 1 went on"):
                await model.register(b)
            assert time.monotonic() - start < 30
            with pytest.raises(DistributedError, match="failed on rank 0"):  # and every later call
                await art.TrainableModel(name="other", project="mgpu", base_model=str(tiny_model_dir)).register(b)
        finally:
            start = time.monotonic()
            await b.close()
            assert time.monotonic() - start < 45

    asyncio.run(run())


def test_a_registration_that_fails_on_a_worker_while_rank_0_still_loads_stops_the_run(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    """The mirror case: a worker's load fails at once while rank 0's goes on, waiting (as in a
    tensor-parallel engine's first all-reduce) for that worker. Rank 0 loads on a thread of its own,
    so registration still raises a DistributedError naming the worker's error and rank 0, instead of
    waiting for the collective's timeout."""
    from tempering.service import hub

    release = threading.Event()

    class Stranded:  # rank 0's load, waiting for a peer that will never come (released at the end)
        def __init__(self, *args, **kwargs):
            release.wait(60)

        def close(self):
            pass

    monkeypatch.setattr(hub, "ModelService", Stranded)  # this process is rank 0; the worker loads for real
    monkeypatch.setattr(hub, "PEER_GRACE_S", 1.0)

    async def run():
        b = art.LocalBackend(path=tmp_path, device="cpu", gpus=2)
        try:
            start = time.monotonic()
            with pytest.raises(DistributedError, match=r"failed on rank 1 \(ConfigError: max_seq_len must be at "
                                                       r"least 2 tokens, got 1\) while rank\(s\) 0 went on"):
                # the worker refuses max_seq_len=1; rank 0's stand-in never looks at it
                await asyncio.to_thread(b.hub.register, name="tiny", project="mgpu", model_json={},
                                        base_model=str(tiny_model_dir), max_seq_len=1)
            assert time.monotonic() - start < 30
        finally:
            release.set()
            await b.close()

    asyncio.run(run())


def test_a_tensor_parallel_engine_that_fails_mid_step_stops_the_run(tiny_model_dir, tmp_path):
    """Rank 0's engine (the TP leader) fails after sending a step, whose all-reduce its follower then
    waits in: the request fails, the leader's engine refuses new work, and the run stops with a
    DistributedError naming the engine's error (later calls fail at once), instead of the leader
    sending the next steps into a group one rank short."""
    from tempering.errors import EngineError

    async def run():
        b = art.LocalBackend(path=tmp_path, device="cpu", gpus=2,
                             engine_config=dataclasses.replace(ENGINE, tensor_parallel_size=2))
        try:
            model = art.TrainableModel(name="tiny", project="mgpu", base_model=str(tiny_model_dir))
            await model.register(b)
            service = b.hub.service("tiny")
            runner = service.engine.runner
            send = runner._send_step

            def send_then_fail(prepared):
                send(prepared)  # the follower runs this step and waits for rank 0 in its all-reduce
                raise RuntimeError("injected failure after sending the step")

            runner._send_step = send_then_fail
            prompt = service.renderer.render_prompt([{"role": "user", "content": "Say a number."}])
            with pytest.raises(EngineError, match="injected failure"):
                service.submit(prompt, SamplingParams(max_tokens=8)).result(60)
            deadline = time.monotonic() + 10
            while b._driver.error is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert isinstance(b._driver.error, DistributedError)
            assert re.search(r"tensor-parallel engine of 'tiny' failed on rank 0 \(RuntimeError: injected",
                             str(b._driver.error))
            with pytest.raises(EngineError, match="the run stops"):
                service.submit(prompt, SamplingParams(max_tokens=8))
        finally:
            start = time.monotonic()
            await b.close()
            assert time.monotonic() - start < 45

    asyncio.run(run())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_two_processes_exits_with_the_error_when_a_worker_dies(tmp_path):
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "tempering.cli", "serve", "--gpus", "2", "--device", "cpu",
                              "--insecure", "--port", str(port), "--root", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None, serve.communicate()[1][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tempering serve --gpus 2 did not come up"
            time.sleep(0.5)
        children = Path(f"/proc/{serve.pid}/task/{serve.pid}/children").read_text().split()
        assert len(children) == 1  # one worker: rank 1
        os.kill(int(children[0]), signal.SIGKILL)
        _, err = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 1
    assert "tempering serve stopped: worker rank 1" in err and "SIGKILL" in err
