"""The dtypes a service runs in are checked before anything loads."""

from __future__ import annotations

import pytest
import torch

from tempering.errors import ConfigError
from tempering.service.service import ModelService
from tempering.storage import ModelPaths


def test_float32_on_a_gpu_is_refused_at_startup_with_the_dtypes_that_work(tmp_path):
    with pytest.raises(ConfigError, match=r"torch\.bfloat16 \(the default\) or torch\.float16"):
        ModelService(ModelPaths(tmp_path, "p", "m"), "no-such-model", device="cuda", dtype=torch.float32)
    assert not any(tmp_path.iterdir())  # refused before resolving or writing anything
