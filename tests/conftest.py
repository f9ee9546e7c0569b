"""Shared fixtures: the real default model (converted once per machine), tiny helpers."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_dir():
    from tempering.service.base_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """(model, tokenizer) of the default model in fp32, as transformers loads it (the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    return model, tokenizer
