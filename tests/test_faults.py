"""Real faults, injected into real runs of the default model: a disk that fills during a checkpoint
write, `kill -9` at chosen and at random moments, damaged checkpoint files, clients that go away
mid-stream or send too much, and memory that runs out inside a training step.

The disk and memory faults and the kills happen in child processes (tests/fault_child.py): the OS
refuses the write (RLIMIT_FSIZE) or the memory (RLIMIT_AS), or the process dies by SIGKILL at the
named moment. No function is patched to raise.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

import tempering as art
from tempering.engine.memory import release_free_memory
from tempering.errors import CheckpointError
from tempering.storage import ModelPaths, list_checkpoints, read_history, read_trajectories

CHILD = Path(__file__).with_name("fault_child.py")
BASE = "SmolLM2-135M-Instruct"


def child(root: Path, scenario: str, options: dict | None = None, *, base_model: str = BASE,
          timeout_s: float = 600) -> tuple[list[dict], int, str]:
    """Run tests/fault_child.py to its end (or its death); its JSON records, return code and stderr's tail."""
    proc = subprocess.run([sys.executable, str(CHILD), str(root), str(base_model), scenario, json.dumps(options or {})],
                          capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.returncode, proc.stderr[-3000:]


def killed_at_random(root: Path, base_model: Path, until: int, rng: random.Random,
                     step_s: float) -> tuple[list[dict], int]:
    """A `train` child, SIGKILLed at a random moment of its first training call or the one after."""
    proc = subprocess.Popen([sys.executable, str(CHILD), str(root), str(base_model), "train",
                             json.dumps({"until": until})],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    records = []
    for line in proc.stdout:
        records.append(json.loads(line))
        if "training" in records[-1]:
            time.sleep(rng.uniform(0, 2 * step_s))
            proc.kill()
            break
    proc.wait(60)
    for line in proc.stdout:  # what it printed before it died (a line cut short by the kill is dropped)
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    proc.stdout.close()
    return records, proc.returncode


# (the moment of the kill, the training call's step it strikes, the step a restart resumes at)
KILLS = [
    ("optimizer_step", 3, 2),  # the adapter updated in memory, nothing written
    ("checkpoint_file", 3, 2),  # half the checkpoint's files written in its temporary directory
    ("checkpoint_rename", 3, 2),  # every file written and flushed, the rename not done
    ("drop_state", 3, 3),  # the new checkpoint in place, the older one's optimizer state half deleted
    ("retention_delete", 4, 4),  # keep_last_checkpoints=3: step 1 renamed for deletion, not deleted
    ("compaction", 5, 5),  # a trajectory file gzipped and renamed, its plain file not deleted
    ("history_append", 6, 6),  # the step saved, its history row not written
]


def test_kill_9_at_any_moment_resumes_at_the_last_complete_step_and_trains_on(tmp_path, tiny_model_dir):
    """Ten processes in a row: each checks on its start what the one before it left, then trains
    until it is killed (at a named moment, then at random ones), the last to a clean end. They run
    the 2-layer random Llama of conftest: what is tested is what reaches the disk, and each process
    starts in seconds."""
    paths = ModelPaths(tmp_path, "faults", "m")

    def check_restart(registered: dict, expected: set[int], why: str) -> None:
        assert registered["registered"] in expected, (why, registered)
        assert registered["registered"] == registered["latest_on_disk"], (why, registered)
        assert registered["strays"] == [] and registered["damaged"] == [], (why, registered)
        assert registered["optimizer_state"], (why, registered)  # the newest checkpoint's, restored

    expected, why = {0}, "a fresh start"
    for moment, step, resumes_at in KILLS:
        records, code, err = child(tmp_path, "train", {"until": step, "kill_at": moment, "kill_step": step},
                                   base_model=tiny_model_dir)
        if expected != {0}:
            check_restart(records[0], expected, why)
        assert code == -9 and records[-1] == {"training": step}, (moment, records, err)
        expected, why = {resumes_at}, f"a kill at {moment} in step {step}"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(2):  # kill -9 at a random moment of the first 2 s of training
        # `until` far enough that the process is still training when the kill comes
        records, code = killed_at_random(tmp_path, tiny_model_dir, max(expected) + 50, rng, step_s=1.0)
        check_restart(records[0], expected, why)
        assert code == -9, (seed, records)
        trained = max([r["trained"] for r in records if "trained" in r], default=records[0]["registered"])
        expected, why = {trained, trained + 1}, f"a random kill (seed {seed}) after step {trained}"
    records, code, err = child(tmp_path, "train", {"until": max(expected) + 1}, base_model=tiny_model_dir)
    check_restart(records[0], expected, why)
    assert code == 0 and records[-1] == {"done": max(expected) + 1}, err
    assert "served_kept_step" in records[1]  # an older kept step, without optimizer state, served from its files
    # what the run left is whole and readable
    saved = [c.step for c in list_checkpoints(paths.checkpoints_dir)]
    assert len(saved) == 3 and saved[-1] == max(expected) + 1  # keep_last_checkpoints=3
    assert all(not (paths.checkpoint(s) / "optimizer.pt").exists() for s in saved[:-1])
    rows = read_history(paths.history)
    assert rows and all(r["step"] < saved[-1] for r in rows)
    assert read_trajectories(paths.trajectories("train", 1))  # gzipped; the kill came inside its compaction


def test_a_disk_full_during_a_checkpoint_write_is_reported_and_the_run_goes_on(tmp_path):
    [record], code, err = child(tmp_path, "disk_full")
    assert code == 0, err
    # the OS refused the write (EFBIG under RLIMIT_FSIZE: a full disk's ENOSPC is handled alike)
    assert record["error"]["type"] == "CheckpointError", record
    assert "File too large" in record["error"]["message"] or "FileTooLarge" in record["error"]["message"]
    assert "free space" in record["error"]["message"]
    assert record["after"] == {"step": 1, "checkpoints": ["0001"]}  # undone, no temporary directory left
    assert record["served_saved_step"]  # the server answers, and step 1 loads from its files
    assert record["retried_step"] == 2 and record["checkpoints"] == ["0001", "0002"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps memory on Linux")
def test_running_out_of_memory_in_a_training_step_undoes_it_and_names_the_knob(tmp_path):
    # a step of two 1,500-token trajectories without gradient checkpointing needs ~4 GB of activations
    [record], code, err = child(tmp_path, "oom", {"completion_tokens": 1500, "headroom_mb": 1024})
    assert code == 0, err
    error = record["error"]
    assert error is not None and error["type"] == "OutOfMemoryError" and error["is_memory_error"], record
    assert "micro_batch_tokens=16384" in error["message"] and "gradient_checkpointing" in error["message"]
    assert "The step was undone" in error["message"]
    assert record["step_after_error"] == 1 and record["served"] and record["retried_step"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA out-of-memory error needs a GPU (CPU twin above)")
def test_running_out_of_gpu_memory_in_a_training_step_undoes_it_and_the_server_keeps_serving(serve_default_model):
    from tempering.types import Choice

    with serve_default_model("gpu-oom") as (model, backend, loop):
        service = backend.hub.service(model.name)

        async def rollouts():
            client = model.openai_client()
            out = []
            for reward in (0.0, 1.0):
                c = await client.chat.completions.create(model=model.name, max_tokens=4,
                                                         messages=[{"role": "user", "content": "Hi"}])
                out.append(art.Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, c.choices[0]],
                                          reward=reward))
            return [art.TrajectoryGroup(out)]

        loop.run_until_complete(model.train(loop.run_until_complete(rollouts())))
        prompt = service.renderer.render_prompt([{"role": "user", "content": "Hi"}])
        # two sequences filling the context: without gradient checkpointing ~20 GB of activations in
        # float32, far past the 1 GiB the cap below leaves
        length = service.max_seq_len - len(prompt) - 8
        big = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"},
               Choice.model_validate({"index": 0, "finish_reason": "length", "message": {"role": "assistant",
                                      "content": "x"}, "token_ids": [1000 + (i % 3000) for i in range(length)],
                                      "prompt_token_ids": prompt, "sampled_logprobs": [-1.0] * length})],
               reward=float(r)) for r in range(2)])]
        device = service.device
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(device) + (1 << 30)) / total),
                                                   device)
        try:
            with pytest.raises(art.errors.OutOfMemoryError, match="micro_batch_tokens"):
                loop.run_until_complete(model.train(big, config=art.TrainConfig(gradient_checkpointing=False)))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        assert loop.run_until_complete(model.get_step()) == 1
        assert loop.run_until_complete(model.train(loop.run_until_complete(rollouts()))).step == 2


# ---- damaged checkpoint files -------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A model directory with checkpoints of steps 1 and 2 of the default model."""
    root = tmp_path_factory.mktemp("two-steps")
    records, code, err = child(root, "train", {"until": 2})
    assert code == 0 and records[-1] == {"done": 2}, err
    return root


def test_a_truncated_checkpoint_is_named_and_resume_falls_back_to_the_previous_one(two_steps, tmp_path, caplog):
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    paths = ModelPaths(tmp_path, "faults", "m")
    weights = paths.checkpoint(2) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])  # as a crashed copy leaves it

    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="m", project="faults", base_model=BASE)
            with caplog.at_level(logging.WARNING, logger="tempering"):
                await model.register(backend)
            assert await model.get_step() == 1
            text = caplog.text
            assert f"checkpoint file {weights} is truncated" in text and "not resuming from step 2" in text
            assert "holds no optimizer state" in text  # step 1 was not the newest: AdamW restarts, and says so
            assert sorted(p.name for p in paths.checkpoints_dir.iterdir()) == ["0001", "0002.damaged"]
            client = model.openai_client()
            completion = await client.chat.completions.create(model=model.name, max_tokens=4,
                                                              messages=[{"role": "user", "content": "Hi"}])
            group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"},
                                                                              completion.choices[0]], reward=r)
                                         for r in (0.0, 1.0)])
            assert (await model.train([group])).step == 2  # trains on from step 1

    asyncio.run(check())


def test_a_corrupted_checkpoint_is_named_when_served_or_forked(two_steps, tmp_path):
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    paths = ModelPaths(tmp_path, "faults", "m")
    weights = paths.checkpoint(1) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle: same size
    weights.write_bytes(bytes(data))

    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="m", project="faults", base_model=BASE)
            await model.register(backend)
            assert await model.get_step() == 2  # the newest checkpoint is whole
            with pytest.raises(Exception, match=r"adapter_model\.safetensors is corrupted"):
                await model.openai_client().chat.completions.create(
                    model=model.get_inference_name(1), max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
            fork = art.TrainableModel(name="fork", project="faults", base_model=BASE)
            with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors is corrupted"):
                await backend.fork_checkpoint(fork, from_project="faults", from_model="m", step=1)

    asyncio.run(check())


# ---- clients that go away, and requests over the limits --------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_thousand_mid_stream_disconnects_and_oversized_requests_leave_memory_and_kv_blocks_as_they_were(
        serve_default_model):
    with serve_default_model("disconnects") as (model, backend, loop):
        engine = backend.hub.service(model.name).engine
        client = model.openai_client()
        body = {"model": model.name, "stream": True, "max_tokens": 200, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me a long story about a river."}]}

        async def idle() -> None:
            for _ in range(600):
                if engine.is_idle:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the engine still has work a minute after its clients left")

        async def disconnect(http: httpx.AsyncClient, count: int) -> None:
            for _ in range(count):
                async with http.stream("POST", "chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            break  # the first token is out: go away mid-stream

        async def wave(count: int) -> None:
            async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120,
                                         headers={"Authorization": f"Bearer {client.api_key}"}) as http:
                await asyncio.gather(*(disconnect(http, count // 8) for _ in range(8)))
            await idle()

        def settled_rss() -> int:
            gc.collect()
            release_free_memory()
            return _rss_bytes()

        loop.run_until_complete(wave(80))  # warm-up: the allocator's pools, the prefix cache, HTTP connections
        free_blocks, rss = engine.blocks.num_free_blocks, settled_rss()
        loop.run_until_complete(wave(1000))
        assert engine.blocks.num_free_blocks == free_blocks
        grown = settled_rss() - rss
        assert grown < 32 << 20, f"the process grew by {grown >> 20} MiB over 1,000 disconnects"

        async def oversized() -> list[int]:
            async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120,
                                         headers={"Authorization": f"Bearer {client.api_key}"}) as http:
                too_long = {**body, "stream": False, "messages": [{"role": "user", "content": "word " * 20_000}]}
                huge = b'{"model": "' + model.name.encode() + b'", "messages": [], "pad": "' + b"x" * (65 << 20) + b'"}'
                answers = [await http.post("chat/completions", json=too_long),
                           await http.post("chat/completions", content=huge, headers={"Content-Type": "application/json"})]
                ok = await http.post("chat/completions", json={**body, "stream": False, "max_tokens": 4})
                return [a.status_code for a in answers] + [ok.status_code]

        assert loop.run_until_complete(oversized()) == [400, 413, 200]
        loop.run_until_complete(idle())
        assert engine.blocks.num_free_blocks == free_blocks
        grown = settled_rss() - rss
        assert grown < 32 << 20, f"the process grew by {grown >> 20} MiB after the oversized requests"
