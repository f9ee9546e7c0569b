"""An architecture tempering has no model code for (a tiny random Phi-3) runs the whole loop through
the transformers fallback: register, rollouts, a train step, a checkpoint; the service says why."""

from __future__ import annotations

import asyncio
import logging

import torch

import tempering as art


def tiny_phi3(directory, tokenizer_dir):
    """A 2-layer Phi-3 with random weights and the default model's tokenizer (and chat template)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.Phi3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


async def rollout(model, prompt: str) -> art.Trajectory:
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt}])
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=trajectory.messages(), max_tokens=6, temperature=1.0)
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    trajectory.reward = float(len(choice.message.content or ""))  # differs between samples: every group has spread
    return trajectory


def test_a_phi3_model_trains_through_the_transformers_fallback_and_the_service_says_so(tmp_path, caplog,
                                                                                         default_model_dir):
    tiny_phi3(tmp_path / "phi3", default_model_dir)
    root = tmp_path / "runs"

    async def run():
        async with art.LocalBackend(path=root) as backend:
            model = art.TrainableModel(name="phi", project="fallback", base_model=str(tmp_path / "phi3"))
            await model.register(backend)
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, p) for _ in range(3)) for p in ("Hi.", "Name a color.")),
                pbar_desc=None)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
            service = backend._registry.get("phi")
            return result, service

    with caplog.at_level(logging.INFO, logger="tempering"):
        result, service = asyncio.run(run())
    assert type(service.engine).__name__ == "HFEngine" and service.trainer.decoder is None
    assert "phi (" in caplog.text and "served by the transformers fallback engine" in caplog.text
    assert "no model code for ['Phi3ForCausalLM']" in caplog.text  # the why
    assert "training Phi3ForCausalLM with the transformers model's own forward" in caplog.text
    assert result.step == 1
    checkpoint = root / "fallback" / "models" / "phi" / "checkpoints" / "0001"
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name
    # of the default target modules Phi-3 has o_proj and down_proj (its q/k/v and gate/up are qkv_proj, gate_up_proj)
    wrapped = {name.rsplit(".", 1)[-1] for name, m in service.trainer.model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"o_proj", "down_proj"}
