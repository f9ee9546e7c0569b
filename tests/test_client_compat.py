"""ART client behaviours, with stand-ins for the backend and the server (no model is loaded):
gathering with an exception budget, PipelineTrainer's failures, model.log/register as ART takes
them, RemoteBackend's requests, and appending after a torn JSONL line."""

from __future__ import annotations

import asyncio
import itertools
import json
import warnings

import httpx
import pytest

import tempering as art
from tempering.backends.remote import RemoteBackend
from tempering.errors import BackendError
from tempering.service.schemas import TrainRequest
from tempering.storage import append_history, read_history, write_trajectories
from tempering.types import TrainResult


def _traj(reward=1.0):
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=reward)


async def _ok():
    return _traj()


async def _fail(message="rollout failed"):
    raise RuntimeError(message)


class _Backend:
    """Records what the model hands the backend."""

    def __init__(self):
        self.logged, self.prepared_with = [], "not called"

    async def register(self, model):
        pass

    async def _prepare_backend_for_training(self, model, config=None):
        self.prepared_with = config
        return "http://server/v1", "key"

    def _model_inference_name(self, model, step=None):
        return model.name

    async def _get_step(self, model):
        return 0

    async def _log(self, model, *, split, step, metrics, groups):
        self.logged.append((metrics, groups))


class PipelineModel:
    """A TrainableModel stand-in for PipelineTrainer (its own logic is under test, here and in
    test_client_edges.py): each train call is one step."""

    name, _backend = "fake", None

    def __init__(self):
        self.step = 0

    async def get_step(self):
        return self.step

    async def train(self, groups, config=None):
        self.step += 1
        return TrainResult(step=self.step, num_groups=len(groups), num_groups_trainable=len(groups))

    async def log(self, items, split="val", *, metrics=None, step=None):
        return {f"{split}/reward": 1.0}  # what validation records

    def get_inference_name(self, step=None):
        return self.name


def test_gather_honours_the_budget_for_coroutine_items_and_drops_a_group_whose_coroutine_raised():
    async def group_of_four():  # ART style: a coroutine that awaits its group; one rollout of four fails
        return await art.TrajectoryGroup([_ok(), _ok(), _ok(), _fail()])

    async def main():
        halves = await art.gather_trajectory_groups([group_of_four(), group_of_four()], pbar_desc=None,
                                                    max_exceptions=0.5)
        assert [(len(g), len(g.exceptions)) for g in halves] == [(3, 1), (3, 1)]  # 2 of 8 rollouts failed
        kept = await art.gather_trajectory_groups([group_of_four(), _fail("scenario setup")], pbar_desc=None,
                                                  max_exceptions=2)
        assert [(len(g), len(g.exceptions)) for g in kept] == [(3, 1)]
        with pytest.raises(RuntimeError):  # two failures, a budget of one: the second is raised
            await art.gather_trajectory_groups([group_of_four(), _fail("scenario setup")], pbar_desc=None,
                                               max_exceptions=1)

    asyncio.run(main())


def test_pipeline_max_exceptions_is_a_fraction_of_the_group_and_a_failure_raises_the_rollouts_error():
    calls = itertools.count()

    async def one_in_four_fails(model, scenario, config):
        if next(calls) % 4 == 3:
            raise RuntimeError("one rollout of four fails")
        return _traj(float(scenario))

    async def always_fails(model, scenario, config):
        raise RuntimeError("every rollout fails")

    async def main():
        trainer = art.PipelineTrainer(PipelineModel(), None, one_in_four_fails, range(4), group_size=4,
                                      groups_per_step=2, max_exceptions=0.5, pbar=False)
        result = await trainer.train()
        assert (result.num_steps, result.num_trajectories_trained) == (2, 12)
        trainer = art.PipelineTrainer(PipelineModel(), None, always_fails, range(4), group_size=4,
                                      groups_per_step=2, pbar=False)  # several workers fail at once
        with pytest.raises(RuntimeError, match="every rollout fails"):
            await trainer.train()

    asyncio.run(main())


def test_remote_train_sends_an_explicit_none_so_max_grad_norm_none_reaches_the_server():
    seen = {}

    def handler(request):
        path = request.url.path
        if path.endswith("/train"):
            seen["request"] = TrainRequest.model_validate(json.loads(request.content))  # as the server parses it
            return httpx.Response(202, json={"job_id": "j1"})
        if path.endswith("/events"):
            return httpx.Response(200, content=json.dumps({"seq": 0, "type": "finished", "result": {"step": 1}}))
        return httpx.Response(200, json={"step": 0})

    async def main():
        backend = RemoteBackend("http://server", "key", transport=httpx.MockTransport(handler))
        model = art.TrainableModel(name="m", project="p", base_model="SmolLM2-135M-Instruct")
        await backend.register(model)
        group = art.TrajectoryGroup([_traj(0.0), _traj(1.0)])
        await backend._train_model(model, [group], art.TrainConfig(max_grad_norm=None, learning_rate=1e-4))
        await backend.close()

    asyncio.run(main())
    config = seen["request"].config
    assert (config.max_grad_norm, config.learning_rate) == (None, 1e-4)


def test_a_new_row_after_a_torn_last_line_starts_its_own_line(tmp_path):
    history = tmp_path / "history.jsonl"
    append_history(history, {"step": 1})
    with open(history, "a") as f:
        f.write('{"step": 2, "train/rew')  # a crash mid-write
    append_history(history, {"step": 2})
    assert [row["step"] for row in read_history(history)] == [1, 2]

    trajectories = tmp_path / "0001.jsonl"
    trajectories.write_text('{"group": 0, "rew')
    write_trajectories(trajectories, [[_traj(0.5)]])
    assert json.loads(trajectories.read_text().splitlines()[1])["reward"] == 0.5


def test_remote_log_is_not_repeated_once_it_may_have_reached_the_server_but_is_retried_before():
    appended, attempts = [], itertools.count()

    def lost_reply(request):
        appended.append(request.content)  # the server appended the row; its reply was lost
        raise httpx.ReadTimeout("reply lost", request=request)

    def refused_once(request):
        if next(attempts) == 0:
            raise httpx.ConnectError("connection refused", request=request)  # never reached the server
        appended.append(request.content)
        return httpx.Response(200, json={"status": "ok"})

    async def log_with(handler):
        backend = RemoteBackend("http://server", "key", max_retries=2, transport=httpx.MockTransport(handler))
        try:
            await backend._log(art.Model(name="m", project="p"), split="val", step=3, metrics={}, groups=[])
        finally:
            await backend.close()

    with pytest.raises(BackendError, match="not retried"):
        asyncio.run(log_with(lost_reply))
    assert len(appended) == 1
    appended.clear()
    asyncio.run(log_with(refused_once))
    assert len(appended) == 1


def test_model_log_counts_exception_items_in_the_exception_rate():
    async def main():
        backend = _Backend()
        model = art.Model(name="baseline", project="p")
        await model.register(backend)
        results = await art.gather_trajectories([_ok(), _fail(), _ok()], pbar_desc=None, max_exceptions=1)
        row = await model.log(results, split="val")
        return row, backend.logged

    row, logged = asyncio.run(main())
    assert row["val/exception_rate"] == pytest.approx(1 / 3)
    assert row["val/num_trajectories"] == 2.0
    assert [len(g.exceptions) for g in logged[0][1]] == [1]


def test_register_takes_arts_openai_client_config_passes_it_on_and_warns_of_each_ignored_key():
    config = art.dev.OpenAIServerConfig(server_args=art.dev.ServerArgs(port=8005), log_file="server.log")

    async def main():
        backend = _Backend()
        model = art.TrainableModel(name="m", project="p", base_model="SmolLM2-135M-Instruct")
        with pytest.warns(art.ArtOptionWarning, match=r"server_args\.port, log_file"):
            await model.register(backend, _openai_client_config=config)
        assert backend.prepared_with == config
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            await model.register(backend)  # nothing given: no warning

    asyncio.run(main())


def test_group_takes_plain_exceptions_by_keyword_as_art_does():
    group = art.TrajectoryGroup([_traj()], exceptions=[RuntimeError("rollout 2 failed")])
    assert [(e.type, e.message) for e in group.exceptions] == [("RuntimeError", "rollout 2 failed")]


def test_gather_trajectories_gives_one_result_per_awaitable():
    async def both_players(i):  # e.g. self-play: one awaitable, two trajectories
        return [_traj(i), _traj(-i)]

    out = asyncio.run(art.gather_trajectories([both_players(1), _ok(), both_players(2)], pbar_desc=None))
    assert [[t.reward for t in r] if isinstance(r, list) else r.reward for r in out] == [[1, -1], 1.0, [2, -2]]


def test_a_non_integer_max_exceptions_above_one_allows_its_floor():
    from tempering.types import GatherContext

    assert [GatherContext(max_exceptions=2.5, num_exceptions=n).allows_one_more_exception() for n in range(4)] == \
        [True, True, False, False]  # ART counts the failure, then raises when the count exceeds 2.5
    assert [GatherContext(max_exceptions=3, num_exceptions=n).allows_one_more_exception() for n in range(4)] == \
        [True, True, True, False]
    assert GatherContext(max_exceptions=0.5, num_trajectories=4, num_exceptions=1).allows_one_more_exception()


def test_registering_again_closes_the_previous_endpoints_client(tmp_path):
    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.Model(name="plain", project="p", inference_base_url="http://127.0.0.1:9/v1")
            await model.register(backend)
            first = model.openai_client()
            await model.register(backend)
            assert first.is_closed() and model.openai_client() is not first

    asyncio.run(check())
