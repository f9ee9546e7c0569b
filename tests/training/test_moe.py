"""The trainer's Qwen3-MoE forward (training/moe.py) against transformers + PEFT, and routing replay
against the engine's sampled logprobs (tiny random models, CPU)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from openai.types.chat.chat_completion import Choice

from tempering.engine import Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.modeling.routing_format import encode_routed_experts
from tempering.training import TokenizedSequence, Trainer, tokenize_trajectory
from tempering.training.batching import pack_sequences
from tempering.training.moe import MoEPackedDecoder
from tempering.types import LoRAConfig, Trajectory

from test_decoder import lora_grads, ours, reference_logprobs, sequences

pytestmark = pytest.mark.filterwarnings("ignore:.*_pattern keys did not match any targeted module")


def tiny_moe(dtype=torch.float32, **overrides):
    """3 layers (the middle one a dense MLP), 8 experts of which 2 per token."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{
        "vocab_size": 211, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 512, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, **overrides})
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(dtype)


def trainer_for(model, rank=4) -> Trainer:
    trainer = Trainer.new(model, LoRAConfig(rank=rank, alpha=2 * rank))
    with torch.no_grad():  # B starts at 0: make the adapter matter
        for name, p in trainer.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return trainer


class _Tokens:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Live:  # the trainer's adapter, as the service's LivePolicy presents it to the engine
    adapter_name, key, cache_version, version = "default", ("adapter", "default"), 0, 0

    def activate(self):
        import contextlib

        return contextlib.nullcontext()


def test_moe_forward_matches_the_peft_model_in_logprobs_and_lora_gradients():
    """Without replay the trainer routes by itself, as transformers does: same logprobs, same gradient
    of every LoRA tensor (attention, and each expert's gate/up and down), with or without recomputation."""
    trainer = trainer_for(tiny_moe())
    assert isinstance(trainer.decoder, MoEPackedDecoder)
    names = [n for n, p in trainer.peft_model.named_parameters() if p.requires_grad]
    assert any("experts.lora_A" in n for n in names) and any("experts.base_layer.lora_B" in n for n in names)
    seqs = sequences(trainer.model.config.vocab_size)
    ref = reference_logprobs(trainer, seqs)
    upstream = torch.randn(ref.shape[0], generator=torch.Generator().manual_seed(2))
    ref_grads = lora_grads(trainer, ref, upstream)
    for checkpointing in (False, True):
        lp = ours(trainer, seqs, checkpointing=checkpointing)
        torch.testing.assert_close(lp, ref, atol=2e-5, rtol=1e-5)
        for g, g_ref in zip(lora_grads(trainer, lp, upstream), ref_grads):
            torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(ours(trainer, seqs, lora=False), reference_logprobs(trainer, seqs, lora=False),
                                   atol=2e-5, rtol=1e-5)


def sample_with_routing(model, trainer, prompts, *, max_tokens, n=2):
    """Samples of the live adapter (temperature 1) with their routed experts, as Choices from a tempering server."""
    engine = Engine(engine_model_for(model, 512), _Tokens(), stop_token_ids=[0], lock=threading.RLock(),
                    config=EngineConfig(num_kv_blocks=64, block_size=16), max_seq_len=512,
                    peft_model=lambda: trainer.peft_model)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, ignore_eos=True, return_routed_experts=True)
        futures = [engine.submit(p, params, n=n, policy=_Live()) for p in prompts]
        results = [(p, c) for p, f in zip(prompts, futures) for c in f.result(timeout=600)]
    finally:
        engine.close()
    return [(p, Choice.model_validate({
        "index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "x"},
        "token_ids": c.token_ids, "sampled_logprobs": c.logprobs, "prompt_token_ids": p,
        "routed_experts": encode_routed_experts(c.routed_experts)})) for p, c in results]


def trainer_logprobs(trainer, choices, *, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the trainer's logprobs, the sampled ones) of every completion token, through tokenize and packing."""
    seqs = []
    for _, choice in choices:
        trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=1.0)
        seqs += tokenize_trajectory(trajectory, None, max_seq_len=512, routing_replay=replay)
    assert all((s.routed_experts is not None) == replay for s in seqs)
    got, sampled = [], []
    with torch.no_grad(), trainer._forward_mode(False):
        for micro in pack_sequences(seqs, max_tokens=4096, share_prefixes=True):  # n=2 samples share their prompt
            got.append(trainer._logprobs(micro)[0].float())
            sampled.append(micro.row().sampled_logprobs)
    return torch.cat(got), torch.cat(sampled)


def test_with_routing_replay_the_trainer_logprobs_equal_the_engines():
    """The engine's routed experts travel as choice.routed_experts → tokenize → packed row (shared
    prompts included) → the trainer, which then computes the sampled logprobs to float32 precision."""
    model = tiny_moe()
    trainer = trainer_for(model, rank=8)
    prompts = [torch.randint(1, 211, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (18, 35)]
    choices = sample_with_routing(model, trainer, prompts, max_tokens=16)
    got, sampled = trainer_logprobs(trainer, choices, replay=True)
    assert len(got) == 4 * 16
    torch.testing.assert_close(got, sampled, atol=1e-4, rtol=0)


def test_routing_replay_removes_the_mismatch_of_near_tied_routers():
    """bf16, routers scaled so that experts' scores are near-tied, then nudged by 3% of their spread after sampling
    (as any difference between the sampler's and the trainer's numbers would): without replay some
    tokens go to other experts and their logprobs differ by far more than rounding; with replay
    every token is within rounding. (The engine and the trainer round alike, so unnudged they flip
    no expert here: modeling/precision.py.)"""
    model = tiny_moe(torch.bfloat16, num_experts=16, num_experts_per_tok=4, mlp_only_layers=[], num_hidden_layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(0.3)  # near-tied router scores
            layer.mlp.experts.gate_up_proj.mul_(8.0)  # experts that differ enough for a flip to show
            layer.mlp.experts.down_proj.mul_(8.0)
    trainer = trainer_for(model, rank=8)
    prompts = [torch.randint(1, 211, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 47)]
    choices = sample_with_routing(model, trainer, prompts, max_tokens=32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.add_((torch.randn(w.shape, generator=g) * w.float().std() * 3e-2).to(w.dtype))
    error = {}
    for replay in (False, True):
        got, sampled = trainer_logprobs(trainer, choices, replay=replay)
        error[replay] = (got - sampled).abs()
    assert error[True].max() < 0.03  # bf16 rounding
    assert error[False].max() > 2 * error[True].max() and error[False].mean() > error[True].mean()


def test_tokenize_keeps_a_later_turns_routing_for_the_merged_sequence_and_packing_pads_it():
    def choice(prompt, completion, routed):
        return Choice.model_validate({
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"},
            "token_ids": completion, "sampled_logprobs": [-1.0] * len(completion), "prompt_token_ids": prompt,
            **({"routed_experts": encode_routed_experts(routed)} if routed is not None else {})})

    first = np.full((4 + 3 - 1, 2, 2), 1, dtype=np.uint8)
    second = np.full((7 + 2 + 2 - 1, 2, 2), 2, dtype=np.uint8)
    turns = [choice([1, 2, 3, 4], [5, 6, 7], first), {"role": "user", "content": "more"},
             choice([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], second)]
    [seq] = tokenize_trajectory(Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, *turns], reward=1.0),
                                None, max_seq_len=64)
    assert seq.routed_experts.shape == (11, 2, 2)
    assert (seq.routed_experts[:-1] == 2).all() and (seq.routed_experts[-1] == -1).all()  # the last token: never an input
    plain = TokenizedSequence([1, 2, 3], [False, True, True], [math.nan, -1.0, -1.0])  # a choice without routing
    micro = pack_sequences([seq, plain], max_tokens=64)[0]
    row = micro.row()
    assert row.routed_experts.shape == (14, 2, 2) and (row.routed_experts[11:] == -1).all()
    from tempering.training.batching import RowShape

    padded = micro.row(RowShape.bucket(micro))
    assert padded.routed_experts.shape[0] == padded.input_ids.shape[0] and (padded.routed_experts[14:] == -1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_rows_replay_from_cuda_graphs_like_eager_rows_with_routed_experts():
    """On a GPU (bf16, grouped GEMMs with device offsets): a row with routed experts to replay is
    captured and replayed from a CUDA graph, giving the eager run's loss statistics and LoRA gradients,
    after the adapter changed in place."""
    from tempering.training.objective import rl_objective
    from tempering.types import TrainConfig

    model = tiny_moe(torch.bfloat16, hidden_size=128, moe_intermediate_size=64, head_dim=32).cuda()
    trainer = trainer_for(model, rank=8)
    config = TrainConfig(learning_rate=1e-3, micro_batch_tokens=1024)
    g = torch.Generator().manual_seed(3)
    seqs = sequences(trainer.model.config.vocab_size, lengths=(120, 77, 41))
    for s in seqs:  # k distinct experts per token and MoE layer, as a sampler routes them
        s.routed_experts = torch.rand(len(s), 2, 8, generator=g).argsort(-1)[..., :2].to(torch.int16).numpy()
        s.routed_experts[-1] = -1
    trainer.step(seqs, config)  # captures this shape's graph, then updates the adapter in place
    assert trainer.rows.capture_error is None and trainer.rows.num_captures >= 1
    objective = lambda row: rl_objective(trainer._row_logprobs, row, config)
    [micro] = pack_sequences(seqs, max_tokens=1024, weights=[0.01] * len(seqs))
    out = []
    for capture in (True, True, False):  # capture (with its eager warm-up), replay, plain eager
        trainer.rows.begin_update()
        with trainer._forward_mode(True):
            stats = trainer.rows.run(micro, objective, ("probe",), capture=capture, pad=True).clone()
        out.append((stats, [gr.clone() for gr in trainer.rows.grads]))
    for stats, grads in out[1:]:
        torch.testing.assert_close(stats, out[0][0], rtol=1e-3, atol=1e-4)
        for a, b in zip(grads, out[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)
