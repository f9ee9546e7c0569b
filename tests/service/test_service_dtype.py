"""The dtypes a service runs in are checked before anything loads."""

from __future__ import annotations

import pytest
import torch

from tempering.engine import EngineConfig
from tempering.errors import ConfigError
from tempering.service.service import CUDA_DTYPES, ModelService
from tempering.storage import ModelPaths


def test_a_dtype_the_gpu_path_does_not_serve_is_refused_at_startup_with_the_dtypes_that_work(tmp_path):
    with pytest.raises(ConfigError, match=r"torch\.bfloat16, torch\.float16 or torch\.float32"):
        ModelService(ModelPaths(tmp_path, "p", "m"), "no-such-model", device="cuda", dtype=torch.float64)
    assert not any(tmp_path.iterdir())  # refused before resolving or writing anything


def test_float32_on_a_gpu_is_served_but_not_with_the_half_precision_exact_mode(tmp_path):
    assert torch.float32 in CUDA_DTYPES  # the exact reference: IEEE float32 on both sides
    with pytest.raises(ConfigError, match=r"batch_invariant=True\) runs half-precision kernels"):
        ModelService(ModelPaths(tmp_path, "p", "m"), "no-such-model", device="cuda", dtype=torch.float32,
                     engine_config=EngineConfig(batch_invariant=True))
    assert not any(tmp_path.iterdir())


def test_on_a_gpu_a_small_model_runs_in_float32_unless_a_dtype_is_named(tiny_model_dir, monkeypatch):
    """Without a dtype: float32 on a CPU; on a GPU float32 up to FLOAT32_ON_GPU_MAX_PARAMS (the
    engine and the trainer then agree to ~1e-5 nats), bfloat16 above it, with the batch-invariant
    kernels and under tensor parallelism. Decided from the config alone (no GPU needed)."""
    from tempering.service import base_model
    from tempering.service.base_model import default_dtype

    ref = str(tiny_model_dir)
    assert default_dtype(ref, "cpu") == torch.float32
    assert default_dtype(ref, "cuda") == torch.float32
    assert default_dtype(ref, "cuda", batch_invariant=True) == torch.bfloat16
    assert default_dtype(ref, "cuda", tensor_parallel_size=2) == torch.bfloat16
    params = base_model.weight_bytes(ref, torch.float32) // 4
    monkeypatch.setattr(base_model, "FLOAT32_ON_GPU_MAX_PARAMS", params - 1)
    assert default_dtype(ref, "cuda") == torch.bfloat16
    assert default_dtype(ref, "cpu") == torch.float32


def test_arts_dtype_option_sets_the_models_dtype(tiny_model_dir, tmp_path):
    import asyncio

    import tempering as art

    async def register() -> torch.dtype:
        async with art.LocalBackend(path=tmp_path, device="cpu") as backend:
            model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir))
            model._internal_config = art.dev.InternalModelConfig(engine_args=art.dev.EngineArgs(dtype="bfloat16"))
            await model.register(backend)
            service = backend.hub.service("m")
            assert service.model.model.embed_tokens.weight.dtype == torch.bfloat16
            return service.dtype

    assert asyncio.run(register()) == torch.bfloat16  # the CPU's default is float32


def test_a_hubs_dtype_is_every_models_unless_its_registration_names_one(tiny_model_dir, tmp_path):
    from tempering.service.hub import ModelHub

    with pytest.raises(ConfigError, match=r"dtype 'float65' is not a torch dtype"):
        ModelHub(tmp_path, device="cpu", dtype="float65")
    hub = ModelHub(tmp_path, device="cpu", dtype="bfloat16")  # `tempering serve --dtype bfloat16`
    try:
        hub.register(name="a", project="p", model_json={"name": "a", "project": "p"}, base_model=str(tiny_model_dir))
        hub.register(name="b", project="p", model_json={"name": "b", "project": "p"}, base_model=str(tiny_model_dir),
                     dtype="float32")
        assert (hub.service("a").dtype, hub.service("b").dtype) == (torch.bfloat16, torch.float32)
    finally:
        hub.close()
