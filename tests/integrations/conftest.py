"""One served default model for the integration tests (its server starts once)."""

from __future__ import annotations

import asyncio

import pytest

import tempering as art


@pytest.fixture(scope="session")
def served(tmp_path_factory, default_model_dir):
    """(model, backend, loop): a registered TrainableModel on a LocalBackend, and the loop to run coroutines on."""
    loop = asyncio.new_event_loop()
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("integrations"))
    model = art.TrainableModel(name="integrations-test", project="tests", base_model="SmolLM2-135M-Instruct")
    loop.run_until_complete(model.register(backend))
    yield model, backend, loop
    loop.run_until_complete(backend.close())
    loop.close()
