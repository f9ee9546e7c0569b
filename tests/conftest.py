"""Shared fixtures: the real default model (converted once per machine), tiny helpers."""

from __future__ import annotations

import asyncio
import contextlib
import os

# The suite never downloads (nor may the code at run time): a hub id that is not on this machine
# fails at once instead of after the hub's network timeout (~24 s per test without a network).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# LiteLLM (RULER's judges named as ART names them) prices models from its own copy of the price list
# instead of fetching it from GitHub first (three tries, ~10 s, without a network)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import pytest  # noqa: E402
import torch  # noqa: E402


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


def _tiny_random_model(directory, default_model_dir, model_class, config_class, **shape):
    """A random model of `shape` (seed 0) with the default model's vocabulary, tokenizer, chat template and
    stop ids, saved in `directory`."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    base = LlamaConfig.from_pretrained(default_model_dir)
    config = config_class(**shape, vocab_size=base.vocab_size, max_position_embeddings=1024, tie_word_embeddings=True,
                          bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)
    torch.manual_seed(0)
    model = model_class(config)
    model.generation_config = GenerationConfig.from_pretrained(default_model_dir)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """A 2-layer, 64-wide random Llama with SmolLM2's tokenizer, chat template and stop ids (for the
    multi-process tests, where each process loads it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny_random_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir, LlamaForCausalLM, LlamaConfig,
                              hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, default_model_dir):
    """A 2-layer, 64-wide random Qwen3-MoE (8 experts, 2 per token) with SmolLM2's tokenizer and chat template."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _tiny_random_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), default_model_dir, Qwen3MoeForCausalLM,
                              Qwen3MoeConfig, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="session")
def serve_default_model(tmp_path_factory, default_model_dir):
    """A factory of context managers: `with serve_default_model("name") as (model, backend, loop)`
    registers the untrained default model as `name` on a fresh LocalBackend (its own directory) and
    closes both when the block ends; `loop` runs the test's coroutines."""
    import tempering as art

    @contextlib.contextmanager
    def serve(name: str):
        loop = asyncio.new_event_loop()
        backend = art.LocalBackend(path=tmp_path_factory.mktemp(name))
        model = art.TrainableModel(name=name, project="tests", base_model="SmolLM2-135M-Instruct")
        try:
            loop.run_until_complete(model.register(backend))
            yield model, backend, loop
        finally:
            loop.run_until_complete(backend.close())
            loop.close()

    return serve
