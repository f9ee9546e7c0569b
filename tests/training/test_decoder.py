"""The trainer's own forward (training/decoder.py) against the PEFT-wrapped transformers model."""

from __future__ import annotations

import pytest
import torch

from tempering.training import TokenizedSequence, Trainer
from tempering.training.batching import pack_sequences
from tempering.types import LoRAConfig

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=211, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_model(arch: str):
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":  # biased q/k/v
        config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":  # per-head q/k RMSNorm, explicit head_dim
        config = transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma3":  # a local layer (window 16 < the 30-token sequence) and a global one
        config = transformers.Gemma3TextConfig(**TINY, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
                                               layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    model = cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or (arch == "gemma3" and name.endswith("norm.weight")):  # Gemma's norms start at 0
                p.normal_(0, 0.1)
    return model


def sequences(vocab: int, lengths=(30, 17, 9)) -> list[TokenizedSequence]:
    """Longest first: the order in which pack_sequences lays them out in a row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        k = n // 2
        out.append(TokenizedSequence(ids, [False] * (n - k) + [True] * k, [float("nan")] * (n - k) + [-1.0] * k,
                                     temperatures=[1.0] * (n - k) + [0.7] * k, advantage=1.0, group_index=0,
                                     trajectory_index=i))
    return out


def trainer_for(model, dropout=0.0, **lora) -> Trainer:
    trainer = Trainer.new(model, LoRAConfig(rank=4, alpha=8, dropout=dropout, **lora))
    with torch.no_grad():  # B starts at 0: make the adapter matter
        for name, p in trainer.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return trainer


def reference_logprobs(trainer: Trainer, seqs: list[TokenizedSequence], *, lora=True) -> torch.Tensor:
    """Each sequence alone through the PEFT model (no packing), full logits, log-softmax / temperature."""
    out = []
    ctx = trainer.peft_model.disable_adapter() if not lora else torch.enable_grad()
    with ctx:
        for s in seqs:
            ids = torch.tensor(s.token_ids)[None]
            logits = trainer.peft_model(input_ids=ids).logits[0, :-1].float()
            temps = torch.tensor(s.temperatures[1:])
            logp = torch.log_softmax(logits / temps[:, None], -1).gather(1, ids[0, 1:, None]).squeeze(1)
            out.append(logp[torch.tensor(s.loss_mask[1:])])
    return torch.cat(out)


def ours(trainer: Trainer, seqs, *, lora=True, checkpointing=False) -> torch.Tensor:
    [micro] = pack_sequences(seqs, max_tokens=4096)
    assert micro.sequences == seqs
    with trainer._forward_mode(checkpointing):
        logprobs, _ = trainer._logprobs(micro, chunk_size=7, lora=lora)
    return logprobs


def lora_grads(trainer: Trainer, logprobs: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    for p in trainer.params:
        p.grad = None
    (logprobs * upstream).sum().backward()
    return [p.grad.clone() for p in trainer.params]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_packed_forward_matches_the_peft_model_in_logprobs_and_lora_gradients(arch):
    trainer = trainer_for(tiny_model(arch))
    assert trainer.decoder is not None
    seqs = sequences(trainer.model.config.vocab_size)
    ref = reference_logprobs(trainer, seqs)
    upstream = torch.randn(ref.shape[0], generator=torch.Generator().manual_seed(2))
    ref_grads = lora_grads(trainer, ref, upstream)
    for checkpointing in (False, True):
        lp = ours(trainer, seqs, checkpointing=checkpointing)
        torch.testing.assert_close(lp, ref, atol=2e-5, rtol=1e-5)
        for g, g_ref in zip(lora_grads(trainer, lp, upstream), ref_grads):
            torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)
    with torch.no_grad():  # the KL reference: the adapter switched off
        torch.testing.assert_close(ours(trainer, seqs, lora=False), reference_logprobs(trainer, seqs, lora=False),
                                   atol=2e-5, rtol=1e-5)


def test_a_kept_layer_saves_swiglus_input_not_its_output(monkeypatch):
    """Without recomputation down's product keeps silu_and_mul(gate_up) as its recipe: the saved
    tensors shrink by one [T, I] output per layer, and the gradients stay the same (the first test)."""
    import contextlib

    from tempering.training.decoder import PackedDecoder

    trainer = trainer_for(tiny_model("llama"))
    seqs = sequences(trainer.model.config.vocab_size)
    T = sum(len(s) for s in seqs)

    def saved_bytes() -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size() if t.requires_grad or t.grad_fn is not None else 0
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ours(trainer, seqs).sum().backward()
        return total

    import tempering.training.decoder as decoder

    recipes = []

    class Recipe(decoder._Recipe):
        __slots__ = ()

        def __init__(self, gate_up):
            super().__init__(gate_up)
            recipes.append(gate_up.shape)

    monkeypatch.setattr(decoder, "_Recipe", Recipe)
    with_recipe = saved_bytes()
    layers, I = trainer.model.config.num_hidden_layers, trainer.model.config.intermediate_size
    assert recipes == [(T, 2 * I)] * layers  # one per layer, kept as the [T, 2I] input
    monkeypatch.setattr(PackedDecoder, "_act_from_gate_up", lambda self, act, gate_up: contextlib.nullcontext())
    without = saved_bytes()
    # the outer hook no longer sees down's saved tensors: its [T, I] input, and its LoRA A and B
    assert without - with_recipe >= layers * T * I * 4  # float32


def test_packed_forward_matches_on_the_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    trainer = trainer_for(AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32))
    seqs = sequences(trainer.model.config.vocab_size, lengths=(61, 40, 25))
    ref = reference_logprobs(trainer, seqs)
    lp = ours(trainer, seqs, checkpointing=True)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-4)
    upstream = torch.randn(ref.shape[0], generator=torch.Generator().manual_seed(2))
    errors = [float((g - g_ref).norm() / g_ref.norm())
              for g, g_ref in zip(lora_grads(trainer, lp, upstream), lora_grads(trainer, ref, upstream))]
    assert max(errors) < 1e-3, max(errors)  # fp32 sums in another order, through 30 layers


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_attention_windows_match_transformers_in_both_forwards(arch):
    import transformers

    torch.manual_seed(0)
    if arch == "mistral":  # every layer slides
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=16))
    else:  # layers from max_window_layers on slide
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1))
    trainer = trainer_for(model.float())
    seqs = sequences(model.config.vocab_size)  # 30 tokens: longer than the window
    ref = reference_logprobs(trainer, seqs)
    torch.testing.assert_close(ours(trainer, seqs), ref, atol=2e-5, rtol=1e-5)
    trainer.decoder = None  # the transformers forward with packed attention
    torch.testing.assert_close(ours(trainer, seqs), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("out_features", [10, 20], ids=["delta-added-to-output", "lora-folded-into-input"])
def test_lora_linear_matches_autograd_including_a_dropout_branch(out_features):
    from tempering.training.decoder import lora_linear

    torch.manual_seed(0)
    x = torch.randn(13, 12, requires_grad=True)
    weight, bias = torch.randn(out_features, 12), torch.randn(out_features)
    A, B = torch.randn(6, 12, requires_grad=True), torch.randn(out_features, 6, requires_grad=True)
    mask = (torch.rand(13, 12) > 0.3).float() / 0.7  # a dropout mask
    upstream = torch.randn(13, out_features)
    for x_lora in (None, x * mask):
        y = lora_linear(x, weight, bias, A, B, 2.0, x_lora)
        grads = torch.autograd.grad((y * upstream).sum(), (x, A, B))
        x_l = x if x_lora is None else x * mask
        y_ref = x @ weight.T + bias + 2.0 * (x_l @ A.T) @ B.T
        grads_ref = torch.autograd.grad((y_ref * upstream).sum(), (x, A, B))
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-5)


def test_lora_on_some_projections_only():
    trainer = trainer_for(tiny_model("qwen2"), target_modules=["q_proj", "v_proj", "up_proj"])  # not adjacent
    seqs = sequences(trainer.model.config.vocab_size)
    ref = reference_logprobs(trainer, seqs)
    lp = ours(trainer, seqs)
    torch.testing.assert_close(lp, ref, atol=2e-5, rtol=1e-5)
    upstream = torch.randn(ref.shape[0], generator=torch.Generator().manual_seed(2))
    for g, g_ref in zip(lora_grads(trainer, lp, upstream), lora_grads(trainer, ref, upstream)):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


def group_sequences(vocab: int) -> list[TokenizedSequence]:
    """Two RL groups (3 and 2 samples of one prompt each, 24- and 18-token prompts), a multi-turn
    sample whose later turn is context again, and a sequence of its own."""
    g = torch.Generator().manual_seed(3)

    def rand(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    out = []
    for prompt_len, completions in ((24, (9, 14, 5)), (18, (11, 7))):
        prompt = rand(prompt_len)
        for i, n in enumerate(completions):
            ids = prompt + rand(n)
            mask = [False] * prompt_len + [True] * n
            if i == 1:  # a tool result (context) and a second turn
                ids += rand(6) + rand(4)
                mask += [False] * 6 + [True] * 4
            lp = [float("nan") if not m else -0.5 for m in mask]
            out.append(TokenizedSequence(ids, mask, lp, temperatures=[1.0 if not m else 0.8 for m in mask],
                                         advantage=0.5 - i, group_index=prompt_len, trajectory_index=i))
    ids = rand(21)
    out.append(TokenizedSequence(ids, [False] * 15 + [True] * 6, [float("nan")] * 15 + [-1.0] * 6, advantage=1.0))
    return out


@pytest.mark.parametrize("arch,checkpointing", [("qwen2", False), ("qwen2", True), ("gemma3", True)])
def test_an_rl_groups_shared_prompt_is_computed_once_with_the_same_logprobs_and_gradients(arch, checkpointing):
    trainer = trainer_for(tiny_model(arch))
    seqs = group_sequences(trainer.model.config.vocab_size)
    [shared] = pack_sequences(seqs, max_tokens=4096, share_prefixes=True, min_shared_tokens=8)
    [whole] = pack_sequences(seqs, max_tokens=4096)
    assert shared.shares_prefixes and not whole.shares_prefixes
    assert shared.num_tokens == whole.num_tokens - 2 * 24 - 1 * 18  # each prompt held once
    row = shared.row()
    ref = reference_logprobs(trainer, shared.sequences)  # each sequence whole, in the row's sequence order
    order = torch.argsort(row.seq_index, stable=True)  # the row's predictions, grouped by sequence
    with trainer._forward_mode(checkpointing):
        lp, _ = trainer._logprobs(shared, chunk_size=7)
    torch.testing.assert_close(lp[order], ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(row.advantages[order], torch.cat([
        torch.full((s.num_completion_tokens,), s.advantage) for s in shared.sequences]))
    upstream = torch.randn(ref.shape[0], generator=torch.Generator().manual_seed(2))
    ours_upstream = torch.empty_like(upstream)
    ours_upstream[order] = upstream
    for g, g_ref in zip(lora_grads(trainer, lp, ours_upstream), lora_grads(trainer, ref, upstream)):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)


def test_a_shared_prompt_too_large_for_one_row_is_split_and_trained_tokens_are_never_shared():
    seqs = group_sequences(211)
    rows = pack_sequences(seqs, max_tokens=40, share_prefixes=True, min_shared_tokens=8)
    assert sorted(id(s) for m in rows for s in m.sequences) == sorted(id(s) for s in seqs)  # each sequence once
    for m in rows:
        assert int(m.loss_mask.sum()) == sum(s.num_completion_tokens for s in m.sequences)
        assert m.num_tokens <= 40 or len(m.sequences) == 1
    early = TokenizedSequence(list(range(30)), [False] * 3 + [True] * 27, [float("nan")] * 3 + [-1.0] * 27)
    [micro] = pack_sequences([early, early], max_tokens=4096, share_prefixes=True, min_shared_tokens=8)
    assert not micro.shares_prefixes  # a 3-token prompt is not worth sharing
