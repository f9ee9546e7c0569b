"""One served default model for the integration tests (its server starts once)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def served(serve_default_model):
    """(model, backend, loop): a registered TrainableModel on a LocalBackend, and the loop to run coroutines on."""
    with serve_default_model("integrations-test") as served:
        yield served
