"""`LocalBackend(in_process=False)`: the server in a child process, the loop driven over HTTP."""

from __future__ import annotations

import asyncio
import socket

import pytest
import typer

import tempering as art
from tempering.backends.child import ChildProcessBackend
from tempering.cli import _engine_config
from tempering.engine import EngineConfig
from tempering.errors import BackendError


async def _rollout(model, client, a: int) -> art.Trajectory:
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": f"What is {a}+3? Answer with the number only."}])
    completion = await client.chat.completions.create(model=model.get_inference_name(), messages=traj.messages(),
                                                      max_tokens=6, temperature=1.0)
    traj.messages_and_choices.append(completion.choices[0])
    traj.reward = float(len(completion.choices[0].message.content or ""))  # any spread will do
    return traj


def test_in_process_false_trains_through_a_child_process_that_stops_on_close(tmp_path, default_model_dir):
    async def main():
        backend = art.LocalBackend(in_process=False, path=tmp_path, device="cpu", max_batch_size=16)
        assert isinstance(backend, ChildProcessBackend)
        process = backend.process
        assert process.poll() is None
        model = art.TrainableModel(name="child", project="p", base_model=str(default_model_dir))
        await model.register(backend)
        client = model.openai_client()
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(_rollout(model, client, a) for _ in range(4)) for a in (1, 2)), pbar_desc=None)
        result = await backend.train(model, groups, learning_rate=1e-4)
        assert result.step == 1 and await model.get_step() == 1
        assert [c["step"] for c in await backend.list_checkpoints(model)][-1] == 1
        # the trained step is served by the child: name@1 answers
        reply = await client.chat.completions.create(model=model.get_inference_name(1), max_tokens=2,
                                                     messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content is not None
        # ART's fork, over HTTP: the latest step at or before not_after_step
        fork = art.TrainableModel(name="fork", project="p", base_model=str(default_model_dir))
        with pytest.raises(art.UnknownModelError, match="at or before step 0"):
            await backend._experimental_fork_checkpoint(fork, from_model="child", not_after_step=0)
        assert await backend._experimental_fork_checkpoint(fork, from_model="child", not_after_step=5) == 1
        await backend.close()
        assert process.returncode is not None  # the child is gone
        assert (tmp_path / "server.log").exists()

    asyncio.run(main())


def test_a_child_that_dies_gives_an_error_with_its_log(tmp_path, default_model_dir):
    async def main():
        backend = art.LocalBackend(in_process=False, path=tmp_path, device="cpu")
        model = art.TrainableModel(name="child", project="p", base_model=str(default_model_dir))
        await model.register(backend)
        backend.process.kill()
        backend.process.wait()
        with pytest.raises(BackendError, match="exited with code -9.*server.log"):
            await model.get_step()
        await backend.close()

    asyncio.run(main())


def test_a_child_that_cannot_start_gives_an_error_with_its_log(tmp_path):
    with socket.socket() as taken:  # the port the child is told to listen on is in use
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(BackendError, match="(?s)exited with code .* before serving.*server.log"):
            art.LocalBackend(in_process=False, path=tmp_path, device="cpu", port=taken.getsockname()[1])


def test_serve_takes_the_engine_config_as_json():
    assert _engine_config('{"max_num_seqs": 8, "block_size": 32}') == EngineConfig(max_num_seqs=8, block_size=32)
    assert _engine_config(None) is None
    for bad in ("[1]", "{not json", '{"block_size": 3}', '{"no_such_field": 1}'):
        with pytest.raises(typer.BadParameter, match="--engine-config"):
            _engine_config(bad)


def test_a_device_the_machine_lacks_stops_the_child_at_startup_with_the_reason(tmp_path):
    with pytest.raises(BackendError, match="(?s)before serving.*not a device"):
        art.LocalBackend(in_process=False, path=tmp_path, device="no-such-device")
