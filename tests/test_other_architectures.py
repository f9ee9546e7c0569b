"""The whole loop on architectures other than the default model's, built tiny and random in the test:
register, rollouts, a train step, a checkpoint; the service says which path serves the model and why.

- Phi-3: tempering has no model code for it; the transformers fallback serves and trains it.
- Gemma 3: tempering's own engine (Gemma3Model) and training forward (Gemma3PackedDecoder).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

import tempering as art


def tiny_model(arch: str, directory, tokenizer_dir):
    """A 2-layer model with random weights and the default model's tokenizer (and chat template)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if arch == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common))
    else:  # a local layer (window 8, shorter than the prompts) and a global one
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    torch.manual_seed(0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


async def rollout(model, prompt: str) -> art.Trajectory:
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=trajectory.messages(), max_tokens=6, temperature=1.0)
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    trajectory.reward = float(len(choice.message.content or ""))  # differs between samples: every group has spread
    return trajectory


async def register_roll_out_and_train(root, base_model: str):
    async with art.LocalBackend(path=root) as backend:
        model = art.TrainableModel(name="tiny", project="archs", base_model=base_model)
        await model.register(backend)
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, p) for _ in range(3)) for p in ("Hi.", "Name a color.")),
            pbar_desc=None)
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        return result, backend._registry.get("tiny")


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_the_whole_loop_runs_and_the_service_says_which_path_serves_the_model(arch, tmp_path, caplog,
                                                                              default_model_dir):
    tiny_model(arch, tmp_path / arch, default_model_dir)
    root = tmp_path / "runs"
    with caplog.at_level(logging.INFO, logger="tempering"):
        result, service = asyncio.run(register_roll_out_and_train(root, str(tmp_path / arch)))
    if arch == "phi3":
        assert type(service.engine).__name__ == "HFEngine" and service.trainer.decoder is None
        assert "served by the transformers fallback engine" in caplog.text
        assert "no model code for ['Phi3ForCausalLM']" in caplog.text  # the why
        assert "training Phi3ForCausalLM with the transformers model's own forward" in caplog.text
        # of the default targets Phi-3 has o_proj and down_proj (its q/k/v and gate/up are qkv_proj, gate_up_proj)
        modules = service.trainer.model.named_modules()
        wrapped = {name.rsplit(".", 1)[-1] for name, m in modules if hasattr(m, "lora_A")}
        assert wrapped == {"o_proj", "down_proj"}
    else:
        assert type(service.engine.model).__name__ == "Gemma3Model"
        assert type(service.trainer.decoder).__name__ == "Gemma3PackedDecoder"
        assert "served by tempering's engine (Gemma3Model" in caplog.text
        assert "training Gemma3ForCausalLM with tempering's packed forward" in caplog.text
    assert result.step == 1
    checkpoint = root / "archs" / "models" / "tiny" / "checkpoints" / "0001"
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name
