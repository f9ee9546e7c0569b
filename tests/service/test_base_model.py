"""Sizing a base model before loading it, and refusing one that does not fit a GPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tempering.errors import ConfigError
from tempering.service.base_model import check_fits_device, weight_bytes


def save_llama(path, **shape):
    import transformers

    config = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                      max_position_embeddings=128, **shape)
    config.save_pretrained(path)
    return config


def test_the_weight_size_comes_from_the_config_and_counts_tied_embeddings_once(tmp_path):
    import transformers

    config = save_llama(tmp_path, hidden_size=64, intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    expected = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    assert weight_bytes(str(tmp_path), torch.bfloat16) == 2 * expected
    assert weight_bytes(str(tmp_path), torch.float32) == 4 * expected


def test_nothing_is_checked_on_a_cpu(tmp_path):
    save_llama(tmp_path, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    check_fits_device(str(tmp_path), torch.float32, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_model_larger_than_the_gpu_is_refused_naming_tensor_parallelism(tmp_path):
    save_llama(tmp_path, hidden_size=16384, intermediate_size=53248, num_hidden_layers=256)  # ~0.9T parameters
    with pytest.raises(ConfigError, match="GiB per GPU.*larger tensor_parallel_size"):
        check_fits_device(str(tmp_path), torch.bfloat16, "cuda:0")


def test_a_gpu_that_other_processes_fill_is_refused_naming_gpu_memory_fraction(tmp_path, monkeypatch):
    """Four tempering processes started at once on one H200 left a fifth no memory for its CUDA context:
    it failed in torch.cuda.mem_get_info with a bare 'CUDA error: out of memory'."""
    from tempering.engine import memory

    def no_context(device):
        raise torch.AcceleratorError("CUDA error: out of memory")

    monkeypatch.setattr(memory, "cuda_free_bytes", no_context)
    with pytest.raises(ConfigError, match="no memory left for this process.*gpu_memory_fraction"):
        check_fits_device(str(tmp_path), torch.bfloat16, "cuda:0")


def test_a_gpus_free_memory_counts_the_cached_blocks_the_allocator_gives_back(monkeypatch):
    """A closed backend's weights stay in PyTorch's caching allocator, which the driver counts as
    taken: a 72B resume in the same process saw 5.2 GiB free of 79.2 GiB. The allocator gives them
    back first, and the driver's count after that is the answer."""
    from tempering.engine.memory import cuda_free_bytes

    gib = 2**30
    state = {"cached": 40 * gib}

    def empty_cache():
        state["cached"] = 0

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (45 * gib - state["cached"], 80 * gib))
    assert cuda_free_bytes("cuda:0") == (45 * gib, 80 * gib)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_unused_blocks_of_a_live_cuda_graphs_pool_do_not_count_as_free():
    """Blocks in a live graph's private pool cannot hold another tensor (a KV cache): counting them
    as free once sized a 51 GiB cache on an H200 with 33 GiB free, and its allocation failed."""
    from tempering.engine.memory import cuda_free_bytes

    torch.cuda.empty_cache()
    before, _ = torch.cuda.mem_get_info(0)
    size = 2 * 2**30  # float32 elements of 2 GiB; the graph's pool keeps them after the tensor is freed
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(8, device="cuda")
    with torch.cuda.graph(graph):
        scratch = torch.empty(size // 4, device="cuda")
        scratch.fill_(1.0)
        x.add_(scratch[:8])
    del scratch
    assert torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0) >= size  # cached, unused
    free, _ = cuda_free_bytes(0)
    assert free < before - size * 0.9
    del graph
    free, _ = cuda_free_bytes(0)
    assert free > before - size * 0.1


def test_a_worker_rank_converts_a_builtin_model_with_its_weights_and_replaces_an_incomplete_one(
        tmp_path, monkeypatch, tiny_model_dir):
    """transformers writes a model's files on torch.distributed rank 0 only; a worker of
    LocalBackend(gpus=N) converting a built-in model on a fresh cache must still write them, and a
    weightless directory left in the cache is replaced rather than kept or raised on. (The GGUF's
    loading is the tiny model's, to keep the test short.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    from tempering.service import builtin_models

    load_model, load_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: load_model(tiny_model_dir))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: load_tokenizer(tiny_model_dir))
    monkeypatch.setattr(PreTrainedModel, "should_save_on_this_rank", lambda self, is_main_process: False)  # rank 1
    model = builtin_models.BuiltinModel(name="Tiny", aliases=frozenset(), package="tiny", install="",
                                        gguf=lambda scratch: scratch / "tiny.gguf")
    stale = tmp_path / "models" / "Tiny"
    stale.mkdir(parents=True)
    (stale / "tokenizer.json").write_text("{}")
    target = builtin_models.builtin_model_dir(model, tmp_path)
    assert target == stale
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert (target / "tokenizer.json").stat().st_size > 1000
    assert json.loads((target / "conversion.json").read_text())["model"] == "Tiny"
    assert [p.name for p in target.parent.iterdir()] == ["Tiny"]  # nothing left beside it


def test_a_conversion_whose_tokenizer_fails_the_probe_is_refused_and_an_unchecked_cache_is_converted_again(
        tmp_path, monkeypatch, tiny_model_dir):
    """transformers 5.17 converts Gemma 3's tokenizer into one that splits every character: the
    saved tokenizer must give the probe's ids, or nothing enters the cache and the error says to
    upgrade. A cached directory without the conversion record (from before the check) is redone."""
    import dataclasses

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tempering.errors import MissingDependencyError
    from tempering.service import builtin_models

    load_model, load_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: load_model(tiny_model_dir))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: load_tokenizer(tiny_model_dir))
    text = "Hello world, 12+13"
    ids = tuple(load_tokenizer(tiny_model_dir).encode(text, add_special_tokens=False))
    model = builtin_models.BuiltinModel(name="Tiny", aliases=frozenset(), package="tiny", install="",
                                        gguf=lambda scratch: scratch / "tiny.gguf", tokenizer_probe=(text, ids[:-1]),
                                        min_transformers="5.0")
    with pytest.raises(MissingDependencyError, match=r"converted Tiny's tokenizer wrongly.*pip install -U "
                                                     r"\"transformers>=5.0,<6\""):
        builtin_models.builtin_model_dir(model, tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
    with pytest.raises(MissingDependencyError, match=r"needs transformers >= 99"):
        builtin_models.builtin_model_dir(dataclasses.replace(model, min_transformers="99"), tmp_path)

    unchecked = tmp_path / "models" / "Tiny"  # an older version's complete conversion, without the record
    shutil.copytree(tiny_model_dir, unchecked)
    target = builtin_models.builtin_model_dir(dataclasses.replace(model, tokenizer_probe=(text, ids)), tmp_path)
    assert target == unchecked and json.loads((target / "conversion.json").read_text())["tokenizer_probe"] == "passed"


def test_a_converted_tokenizer_whose_eos_is_not_the_models_takes_the_models(default_model_dir):
    """transformers 5.17 converts SmolLM2's GGUF with <|im_start|> (its BOS) as the tokenizer's EOS."""
    import copy

    from transformers import AutoTokenizer

    from tempering.service.builtin_models import match_tokenizer_eos

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    converted = copy.deepcopy(tokenizer)
    converted.eos_token = "<|im_start|>"
    match_tokenizer_eos(converted, [2])  # the GGUF's eos_token_id, in the generation config
    assert converted.eos_token == "<|im_end|>" and converted.eos_token_id == 2
    gemma_like = copy.deepcopy(tokenizer)  # an EOS among several of the model's is kept
    match_tokenizer_eos(gemma_like, [0, 2])
    assert gemma_like.eos_token_id == 2
