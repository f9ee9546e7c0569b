"""`tempering serve` in a real process on 127.0.0.1, driven by RemoteBackend."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import httpx
import pytest

import tempering as art
from tempering.errors import BackendError, TrajectoryError

KEY = "test-key-" + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "TEMPERING_API_KEY": KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tempering.cli", "serve", "--port", str(port), "--root", str(root), "--device", "cpu", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stdout.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("serve-root")
    proc, url = start_server(root)
    yield url, root
    stop(proc)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


async def rollout(model: art.TrainableModel, prompt: str) -> art.Trajectory:
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages(), max_tokens=8, temperature=1.0)
    choice = completion.choices[0]
    traj.messages_and_choices.append(choice)
    logprobs = list(choice.sampled_logprobs)
    traj.reward = math.exp(sum(logprobs) / len(logprobs))  # differs between samples: every group has spread
    return traj


async def gather(model, group_size=3):
    return await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, p) for _ in range(group_size)) for p in ("Name a color.", "Say a number.")),
        pbar_desc=None)


def headers(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_a_remote_client_runs_the_whole_loop(server, loop):
    url, root = server

    async def go():
        async with art.RemoteBackend(url, KEY) as backend:
            model = art.TrainableModel(name="remote-loop", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            assert model.inference_base_url == f"{url}/v1"
            assert await model.get_step() == 0
            result = await model.train(await gather(model), config=art.TrainConfig(learning_rate=1e-3))
            assert result.step == 1 and await model.get_step() == 1
            assert "loss/train" in result.metrics
            result = await backend.train(model, await gather(model), learning_rate=1e-3)  # ART >= 0.5.18 style
            assert result.step == 2
            # which, as ART's, logs nothing: model.train's step 0 is the one train row
            assert [r["step"] for r in await backend._read_history(model) if "train/reward" in r] == [0]
            await model.log([art.Trajectory(messages_and_choices=[], reward=0.7)], split="val")
            checkpoints = await backend.list_checkpoints(model)
            assert [c["step"] for c in checkpoints] == [1, 2]
            assert checkpoints[1]["metrics"]["val/reward"] == 0.7
            await model.delete_checkpoints("val/reward")  # the best is the latest: step 1 goes
            assert [c["step"] for c in await backend.list_checkpoints(model)] == [2]
            served = await model.openai_client().chat.completions.create(
                model=f"{model.name}@2", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert served.choices[0].token_ids
            with pytest.raises(TrajectoryError):
                await model.train([])

    loop.run_until_complete(go())
    assert (root / "tests" / "models" / "remote-loop" / "checkpoints" / "0002" / "adapter_model.safetensors").is_file()


def test_a_remote_pipeline_with_max_staleness_0_trains_on_policy(server, loop):
    url, _ = server

    async def group_rollout(model, prompt, config):
        return await art.TrajectoryGroup(rollout(model, prompt) for _ in range(2))

    async def go():
        async with art.RemoteBackend(url, KEY) as backend:
            model = art.TrainableModel(name="remote-pipe", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            pipeline = art.PipelineTrainer(model, backend, group_rollout, ["Name a color.", "Say a number."] * 4,
                                           groups_per_step=2, max_staleness=0, max_steps=2, learning_rate=1e-3,
                                           pbar=False)
            result = await pipeline.train()
            return result, await backend._read_history(model)

    result, history = loop.run_until_complete(go())
    assert result.step == 2 and result.num_trajectories_trained == 8 and result.num_stale_groups_dropped == 0
    train_rows = [r for r in history if "train/reward" in r]
    assert [r["offpolicy/policy_age_max"] for r in train_rows] == [0.0, 0.0]  # no rollout ran during a step
    assert all(r["data/step_num_trajectories_spanning_update"] == 0 for r in train_rows)


def test_every_route_needs_the_key_and_the_spec_is_served(server):
    url, _ = server
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/register"),
                         ("GET", "/v1/models/x/step"), ("GET", "/openapi.json"), ("POST", "/v1/chat/completions")):
        for auth in ({}, headers("wrong")):
            assert httpx.request(method, f"{url}{path}", headers=auth, timeout=30).status_code == 401, (method, path)
    spec = httpx.get(f"{url}/openapi.json", headers=headers(), timeout=30).json()
    assert "/v1/register" in spec["paths"] and "/v1/models/{name}/train" in spec["paths"]


def test_bad_requests_are_rejected_with_the_field_named_and_cannot_escape_the_root(server):
    url, root = server
    response = httpx.post(f"{url}/v1/register", json={"project": "p"}, headers=headers(), timeout=30)
    assert response.status_code == 422 and "name" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v1/register", json={"name": "x", "project": "p", "color": 1}, headers=headers(), timeout=30)
    assert response.status_code == 422
    for name, project in (("../../escaped", "p"), ("ok", "../escaped"), ("a/b", "p"), (".hidden", "p")):
        response = httpx.post(f"{url}/v1/register", json={"name": name, "project": project}, headers=headers(), timeout=30)
        assert response.status_code in (400, 404, 422), (name, project, response.text)
    for path in ("/v1/models/..%2F..%2Fetc/step", "/v1/models/%2E%2E/history"):
        assert httpx.get(f"{url}{path}", headers=headers(), timeout=30).status_code in (400, 404, 422)
    assert not (root.parent / "escaped").exists() and not (root / "escaped").exists()
    response = httpx.post(f"{url}/v1/models/remote-loop/train", content=b"{not json", headers=headers(), timeout=30)
    assert response.status_code == 422
    response = httpx.post(f"{url}/v1/models/remote-loop/train", json={"request_id": "x" * 8, "groups": [{"trajectories": [1]}]},
                          headers=headers(), timeout=30)
    assert response.status_code == 422 and "groups" in response.json()["error"]["message"]
    # dedicated mode (ART's trainer/inference GPU ids) on a one-GPU server: refused, nothing left behind
    response = httpx.post(f"{url}/v1/register", json={"name": "ded", "project": "p", "base_model": "SmolLM2-135M-Instruct",
                                                      "dedicated_gpus": 2}, headers=headers(), timeout=30)
    assert response.status_code == 400 and "--gpus 2" in response.json()["error"]["message"]
    assert not (root / "p" / "models" / "ded").exists()
    assert httpx.get(f"{url}/health", headers=headers(), timeout=30).status_code == 200


def test_a_second_concurrent_train_is_409_and_a_killed_client_leaves_a_good_checkpoint(server, loop, tmp_path):
    url, root = server

    async def prepare():
        async with art.RemoteBackend(url, KEY) as backend:
            model = art.TrainableModel(name="remote-kill", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            return [g.model_dump(mode="json") for g in await gather(model, group_size=4)]

    groups = loop.run_until_complete(prepare())
    body = {"groups": groups * 4, "config": {"learning_rate": 1e-3}}  # long enough to still run when the 2nd comes
    # a client process starts a training step and is killed while the server trains
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import httpx, json, os, signal, sys
        body = json.load(open(sys.argv[1]))
        r = httpx.post("{url}/v1/models/remote-kill/train", json={{**body, "request_id": "killed-client-1"}},
                       headers={{"Authorization": "Bearer {KEY}"}}, timeout=60)
        print(r.status_code, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    (tmp_path / "body.json").write_text(json.dumps(body))
    client = subprocess.run([sys.executable, str(script), str(tmp_path / "body.json")], capture_output=True, text=True, timeout=120)
    assert client.stdout.strip() == "202" and client.returncode == -signal.SIGKILL
    # while that step runs, another one is refused
    second = httpx.post(f"{url}/v1/models/remote-kill/train", json={**body, "request_id": "second-client-1"},
                        headers=headers(), timeout=60)
    assert second.status_code == 409, second.text

    async def new_client():
        async with art.RemoteBackend(url, KEY) as backend:
            model = art.TrainableModel(name="remote-kill", project="tests", base_model="SmolLM2-135M-Instruct")
            await model.register(backend)
            for _ in range(600):
                if await model.get_step() == 1:
                    break
                await asyncio.sleep(0.2)
            assert await model.get_step() == 1
            result = await model.train(await gather(model), config=art.TrainConfig(learning_rate=1e-3))
            assert result.step == 2  # the model is free again

    loop.run_until_complete(new_client())
    checkpoint = root / "tests" / "models" / "remote-kill" / "checkpoints" / "0001"
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(checkpoint)).r == 8


def test_request_bodies_over_the_limit_are_413(tmp_path):
    proc, url = start_server(tmp_path, "--max-body-mb", "1")
    try:
        response = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (2 << 20),
                              headers={**headers(), "Content-Type": "application/json"}, timeout=30)
        assert response.status_code == 413
        assert httpx.get(f"{url}/health", headers=headers(), timeout=30).status_code == 200
    finally:
        stop(proc)


def test_serve_refuses_to_start_without_a_key(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tempering.cli import app

    monkeypatch.delenv("TEMPERING_API_KEY", raising=False)
    serve = ["serve", "--root", str(tmp_path), "--host", "0.0.0.0"]
    # the command's own checks, in this process (each refuses before it loads anything)
    for extra, message in (([], "no API key"), (["--insecure"], "loopback"),
                           # `--api-key "$KEY"` with KEY unset: an empty key matched an empty bearer token
                           (["--api-key", " "], "API key is empty")):
        out = CliRunner().invoke(app, [*serve, *extra])
        assert out.exit_code != 0 and message in out.output + str(out.exception), (extra, out.output)
    from tempering.service.auth import require_api_key

    with pytest.raises(ValueError, match="empty"):
        require_api_key("")


def test_a_remote_backend_reports_an_unreachable_server():
    async def go():
        async with art.RemoteBackend(f"http://127.0.0.1:{free_port()}", KEY, max_retries=1) as backend:
            with pytest.raises(BackendError, match="cannot reach"):
                await backend._get_step(art.TrainableModel(name="x", project="p", base_model="b"))

    asyncio.run(go())
