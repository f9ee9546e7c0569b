"""Edges of the client API: logging pending groups, the pipeline's last validation, a failed group's
other rollouts, and a child server that dies during a train call."""

from __future__ import annotations

import asyncio
import gc
import time

import httpx
import pytest

import tempering as art
from tempering.errors import BackendError, ConfigError
from test_client_compat import PipelineModel


def test_log_refuses_a_group_that_was_never_awaited(tmp_path):
    async def rollout():
        return art.Trajectory(messages_and_choices=[], reward=1.0)

    async def main():
        async with art.LocalBackend(path=tmp_path, device="cpu") as backend:
            model = art.Model(name="m", project="p")
            await model.register(backend)
            coroutines = [rollout() for _ in range(2)]
            with pytest.raises(ConfigError, match="never awaited.*gather_trajectory_groups"):
                await model.log([art.TrajectoryGroup(coroutines)], step=0)
            for coroutine in coroutines:
                coroutine.close()
            assert await backend._read_history(model) == []  # nothing written

    asyncio.run(main())


@pytest.mark.parametrize(("num_scenarios", "validated"), [(6, [0, 2, 3]), (4, [0, 2])])
def test_the_pipeline_validates_the_last_step_once_when_the_scenarios_run_out(num_scenarios, validated):
    async def rollout(model, scenario, config):
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=float(scenario % 2))

    async def eval_fn(model, step, config):
        return [art.Trajectory(messages_and_choices=[], reward=1.0)]

    async def main():
        trainer = art.PipelineTrainer(PipelineModel(), None, rollout, range(num_scenarios), group_size=2, groups_per_step=2,
                                      eval_every_n_steps=2, eval_fn=eval_fn, pbar=False)
        return await trainer.train()

    result = asyncio.run(main())
    assert result.step == num_scenarios // 2
    assert sorted(result.val_rewards) == validated


def test_a_group_over_its_budget_waits_for_its_other_rollouts():
    reported: list[str] = []
    cleaned_up: list[bool] = []

    async def fails():
        await asyncio.sleep(0.01)
        raise RuntimeError("fails first")

    async def fails_when_cancelled():
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0)  # cleanup that awaits (closing a client, say)
            cleaned_up.append(True)
            raise RuntimeError("its cleanup fails")

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        with pytest.raises(RuntimeError, match="fails first"):
            await art.TrajectoryGroup([fails(), fails_when_cancelled()])
        assert cleaned_up  # done before the error reached the caller
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert reported == []  # no "Task exception was never retrieved"


def test_a_child_that_dies_during_a_train_call_fails_it_promptly_with_its_log(tmp_path, tiny_model_dir):
    async def rollout(model, client):
        traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "What is 1+3?"}])
        completion = await client.chat.completions.create(model=model.get_inference_name(), messages=traj.messages(),
                                                          max_tokens=4, temperature=1.0)
        traj.messages_and_choices.append(completion.choices[0])
        traj.reward = float(len(completion.choices[0].message.content or ""))
        return traj

    async def main():
        backend = art.LocalBackend(in_process=False, path=tmp_path, device="cpu", max_batch_size=8)
        try:
            model = art.TrainableModel(name="child", project="p", base_model=str(tiny_model_dir))
            await model.register(backend)
            client = model.openai_client()
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, client) for _ in range(2)) for _ in range(2)], pbar_desc=None)
            request = backend._request

            async def request_then_kill(method, path, **kwargs):  # the job is accepted, then the child dies
                response = await request(method, path, **kwargs)
                if path.endswith("/train"):
                    backend.process.kill()
                return response

            backend._request = request_then_kill
            start = time.monotonic()
            with pytest.raises(BackendError, match="(?s)exited with code -9.*server.log"):
                await model.train(groups)
            assert time.monotonic() - start < 5  # not the ~25 s of reconnecting to a dead server
        finally:
            await backend.close()

    asyncio.run(main())


def test_closing_the_backend_closes_the_models_openai_client(tmp_path):
    # model.openai_client() pools connections to the backend's server; they once stayed open after
    # backend.close(), one pool per model left behind by every backend of a session
    async def main():
        backend = art.LocalBackend(path=tmp_path, device="cpu")
        model = art.Model(name="m", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k")
        await model.register(backend)
        client = model.openai_client()
        assert model.openai_client() is client and not client._client.is_closed
        await backend.close()
        assert client._client.is_closed
        assert not model.openai_client()._client.is_closed  # a new client; closing it is the caller's

    asyncio.run(main())


def test_a_backend_closes_only_the_clients_of_models_still_registered_with_it():
    async def main():
        def remote() -> art.RemoteBackend:
            return art.RemoteBackend("http://server", "key",
                                     transport=httpx.MockTransport(lambda request: httpx.Response(200, json={})))

        first, second = remote(), remote()
        model = art.Model(name="m", project="p", inference_base_url="http://server/v1", inference_api_key="k")
        await model.register(first)
        await model.register(first)  # registered twice: still closed once, without error
        old = model.openai_client()
        await model.register(second)  # the old endpoint's client goes at once
        assert old._client.is_closed
        current = model.openai_client()
        await first.close()
        assert not current._client.is_closed  # the model moved on: the first backend leaves its client alone
        await second.close()
        assert current._client.is_closed

    asyncio.run(main())
