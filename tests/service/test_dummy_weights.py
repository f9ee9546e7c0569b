"""`EngineConfig(load_format="dummy")`: a model from its config alone (no weights file), random
weights drawn on the device, through the whole loop; the same draws again on resume."""

from __future__ import annotations

import asyncio
import shutil

import pytest

import tempering as art
from tempering.errors import ConfigError
from tempering.engine import EngineConfig


def test_load_format_names_the_two_it_takes():
    with pytest.raises(ConfigError, match=r"'auto' \(the checkpoint's weights\) or 'dummy'"):
        EngineConfig(load_format="safetensors")


def test_a_config_only_model_runs_the_whole_loop_on_random_weights_and_resumes_on_the_same(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "config-only"
    model_dir.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model_dir / f.name)
    probe = [{"role": "user", "content": "Say something."}]

    async def session(train: bool) -> tuple[int, list[float]]:
        async with art.LocalBackend(path=tmp_path / "runs", device="cpu",
                                    engine_config={"load_format": "dummy", "max_num_seqs": 8}) as backend:
            model = art.TrainableModel(name="dummy", project="p", base_model=str(model_dir))
            await model.register(backend)
            client = model.openai_client()
            if train:
                async def rollout(i: int) -> art.Trajectory:
                    messages = [{"role": "user", "content": f"Count to {i}."}]
                    c = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4,
                                                             temperature=1.0)
                    lps = c.choices[0].sampled_logprobs
                    return art.Trajectory(messages_and_choices=[*messages, c.choices[0]], reward=sum(lps) / len(lps))

                groups = [art.TrajectoryGroup([await rollout(g) for _ in range(3)]) for g in range(2)]
                await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
            c = await client.chat.completions.create(model=model.name, messages=probe, max_tokens=4, temperature=0)
            return await model.get_step(), list(c.choices[0].sampled_logprobs)

    step, trained = asyncio.run(session(train=True))
    assert step == 1
    resumed_step, resumed = asyncio.run(session(train=False))
    assert resumed_step == 1
    assert resumed == pytest.approx(trained, abs=1e-5)  # the same random base and the saved adapter


def test_random_shards_differ_by_rank_and_replicated_tensors_do_not():
    import torch
    import transformers

    from tempering.parallel.shard_load import dummy_model

    class Rank:  # the parts of a TensorParallel group that drawing shards reads
        def __init__(self, rank: int) -> None:
            self.rank, self.size = rank, 2

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    a, b = (dummy_model(config, torch.device("cpu"), torch.float32, tp=Rank(r)) for r in (0, 1))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    qa, qb = a.model.layers[0].self_attn.q_proj.weight, b.model.layers[0].self_attn.q_proj.weight
    assert qa.shape == (32, 64) and not torch.equal(qa, qb)  # each rank's own half of the heads
    again = dummy_model(config, torch.device("cpu"), torch.float32, tp=Rank(1))
    assert torch.equal(again.model.layers[0].mlp.down_proj.weight, b.model.layers[0].mlp.down_proj.weight)
