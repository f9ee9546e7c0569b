"""ModelHub registration: a registration that fails leaves nothing on disk, locally and over HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

import tempering as art
from tempering.errors import UnknownModelError
from tempering.service import create_app
from tempering.service.hub import ModelHub
from tempering.service.jobs import TrainJobs

BAD = "no/such-model-anywhere"


def files_under(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_failed_local_registration_leaves_no_model_json_and_frees_the_name(tmp_path):
    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            with pytest.raises(UnknownModelError):
                await art.TrainableModel(name="ghost", project="p", base_model=BAD).register(backend)
            assert files_under(tmp_path) == []
            # the name is free again: the same name registers in another project
            await art.Model(name="ghost", project="other").register(backend)
            assert (tmp_path / "other" / "models" / "ghost" / "model.json").is_file()

    asyncio.run(check())


def test_a_failed_registration_keeps_what_an_existing_model_had(tmp_path):
    hub = ModelHub(tmp_path, device="cpu")
    try:
        hub.register(name="kept", project="p", model_json={"name": "kept", "v": 1})
        before = (tmp_path / "p" / "models" / "kept" / "model.json").read_text()
        with pytest.raises(UnknownModelError):
            hub.register(name="kept", project="p", model_json={"name": "kept", "v": 2}, base_model=BAD)
        assert (tmp_path / "p" / "models" / "kept" / "model.json").read_text() == before
        assert files_under(tmp_path) == ["p", "p/models", "p/models/kept", "p/models/kept/model.json"]
    finally:
        hub.close()


def test_a_failed_v1_register_leaves_no_model_json(tmp_path):
    hub = ModelHub(tmp_path, device="cpu")
    app = create_app(hub.registry, api_key="k", hub=hub, jobs=TrainJobs(hub))

    async def check():
        transport = httpx.ASGITransport(app=app)
        async with art.RemoteBackend("http://test", api_key="k", transport=transport, max_retries=0) as backend:
            with pytest.raises(UnknownModelError):
                await art.TrainableModel(name="ghost", project="p", base_model=BAD).register(backend)
        assert files_under(tmp_path) == []

    try:
        asyncio.run(check())
    finally:
        hub.close()


def test_a_device_this_machine_cannot_run_on_is_refused_at_once(tmp_path):
    import torch

    from tempering.errors import ConfigError

    with pytest.raises(ConfigError, match="not a device"):
        ModelHub(tmp_path, device="no-such-device")
    with pytest.raises(ConfigError, match="runs on 'cpu' or 'cuda'"):
        ModelHub(tmp_path, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            ModelHub(tmp_path, device="cuda")
    ModelHub(tmp_path, device="cpu").close()  # fine
    from tempering.engine import EngineConfig

    with pytest.raises(ConfigError, match="tensor_parallel_size 2 splits each model over 2 GPUs .* this run has 1"):
        ModelHub(tmp_path, device="cpu", engine_config=EngineConfig(tensor_parallel_size=2))


def test_every_rank_of_a_multi_gpu_registration_gets_the_same_options_and_dtype(tmp_path, monkeypatch):
    """Rank 0 loads its service and asks each worker to load the same model with the same options,
    the dtype's name included (a worker in another dtype would compute another function, and under
    tensor parallelism could not take part in the collectives)."""
    import concurrent.futures

    from tempering.service import hub as hub_module

    loaded = {}

    class Service:  # rank 0's, recorded
        def __init__(self, paths, base_model, **kwargs):
            loaded.update(kwargs, base_model=base_model)
            self.step = 0

        def close(self):
            pass

    class Link:  # a worker that registers at once, recorded
        rank, calls = 1, []

        def call(self, method, **kwargs):
            self.calls.append((method, kwargs))
            future = concurrent.futures.Future()
            future.set_result(0)
            return future

    class Driver:
        links = [Link()]

        def fail(self, error):
            raise AssertionError(f"the run was stopped: {error}")

    monkeypatch.setattr(hub_module, "ModelService", Service)
    hub = ModelHub(tmp_path, device="cpu")
    hub.driver = Driver()
    hub._load(hub.paths("p", "m"), "base", max_seq_len=64, dtype="bfloat16", dedicated=False)
    (method, sent), = Link.calls
    assert method == "register" and sent["dtype"] == "bfloat16" and sent["max_seq_len"] == 64
    assert sent["base_model"] == "base" and loaded["dtype"] is torch.bfloat16 and loaded["max_seq_len"] == 64


def test_deleting_checkpoints_during_a_training_step_leaves_the_event_loop_serving(tmp_path, tiny_model_dir):
    """A deletion waits for the model's running training step (its new checkpoint is then the
    latest); it waits in a thread, so the event loop, which also serves inference (the server's) or
    runs the user's rollouts (LocalBackend's caller), goes on meanwhile."""
    import threading
    import time

    async def check():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="busy", project="p", base_model=str(tiny_model_dir))
            await model.register(backend)
            app = create_app(backend.hub.registry, api_key="k", hub=backend.hub, jobs=TrainJobs(backend.hub))
            held, release = threading.Event(), threading.Event()

            def training_step():  # holds the train lock as a step does, 3 s at most
                with backend.hub.service("busy").train_lock:
                    held.set()
                    release.wait(3)

            holder = threading.Thread(target=training_step)
            holder.start()
            held.wait()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         headers={"Authorization": "Bearer k"}) as client:
                local = asyncio.ensure_future(model.delete_checkpoints())
                remote = asyncio.ensure_future(client.post("/v1/models/busy/checkpoints/delete", json={"keep_steps": []}))
                await asyncio.sleep(0.1)
                start = time.perf_counter()
                health = await client.get("/health")
                assert health.status_code == 200 and time.perf_counter() - start < 1.0
                assert not local.done() and not remote.done()  # both still wait for the step
                release.set()
                assert (await remote).status_code == 200 and await local == []
            holder.join()

    asyncio.run(check())


def test_a_training_job_that_raises_a_base_exception_ends_failed_and_frees_the_model(tmp_path, monkeypatch):
    hub = ModelHub(tmp_path, device="cpu")
    monkeypatch.setattr(hub, "service", lambda name: None)  # a registered model
    jobs = TrainJobs(hub)

    def interrupted(on_event):
        raise KeyboardInterrupt

    try:
        job = jobs.start("m", "request-1", interrupted)
        for _ in range(100):
            if job.status != "running":
                break
            time.sleep(0.05)
        assert job.status == "failed" and job.events[-1]["error"]["type"] == "KeyboardInterrupt"
        assert jobs.start("m", "request-2", lambda on_event: None) is not job  # no 409: the model is free
    finally:
        hub.close()
