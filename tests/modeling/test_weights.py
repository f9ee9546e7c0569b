"""The engine and the trainer bind one model's base weights once: q/k/v and gate/up fused into one
allocation (with the engine's spare LoRA rows), which the trainer then reads too."""

import pytest
import torch
import transformers

from tempering.engine.models import LlamaFamilyModel
from tempering.training import Trainer
from tempering.types import LoRAConfig

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, attention_bias=True)


def base_weight_bytes(model) -> int:
    """Bytes of the distinct allocations behind the model's frozen weights (a fused one counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for n, p in model.named_parameters() if "lora_" not in n}
    return sum(storages.values())


@pytest.mark.parametrize("spare_rows", [False, True])
def test_the_trainer_reads_the_engines_fused_weights_and_nothing_is_held_twice(spare_rows):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).requires_grad_(False)
    engine_model = LlamaFamilyModel(model, 256, spare_rows=spare_rows)
    engine_layers = [(lay.qkv, lay.qkv_bias, lay.gate_up) for lay in engine_model.layers]
    after_engine = base_weight_bytes(model)

    trainer = Trainer.new(model, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"]))

    for lay, (qkv, qkv_bias, gate_up) in zip(trainer.decoder.layers, engine_layers):
        for theirs, ours in ((lay.qkv, qkv), (lay.qkv_bias, qkv_bias), (lay.gate_up, gate_up)):
            assert theirs.data_ptr() == ours.data_ptr() and theirs.shape == ours.shape
    assert base_weight_bytes(model) == after_engine  # no second fused copy
    q = model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert q.data_ptr() == engine_layers[0][0].data_ptr()  # the module's own weight: a view of the same rows
