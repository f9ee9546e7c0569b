"""The trainer's Triton kernels and its bf16 forward on CUDA, against the PyTorch twins (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from tempering.training import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def grads_of(fn, *inputs, upstream):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    out.backward(upstream)
    return out.detach(), [x.grad for x in inputs]


@pytest.mark.parametrize("shape", [(300, 1536), (7, 12, 128), (5, 896)])
def test_rms_norm_forward_and_backward_match_torch(shape):
    from tempering.training import triton_kernels

    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.rand(shape[-1], device="cuda", dtype=torch.bfloat16) + 0.5
    dy = torch.randn_like(x)
    y, (dx,) = grads_of(lambda t: triton_kernels.rms_norm(t, w, 1e-6), x, upstream=dy)
    y_ref, (dx_ref,) = grads_of(lambda t: kernels.rms_norm_torch(t, w, 1e-6), x, upstream=dy)
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dx.float(), dx_ref.float(), atol=3e-2, rtol=3e-2)


def test_silu_and_mul_forward_and_backward_match_torch():
    from tempering.training import triton_kernels

    torch.manual_seed(0)
    gate_up = torch.randn(257, 2 * 2100, device="cuda", dtype=torch.bfloat16) * 2
    da = torch.randn(257, 2100, device="cuda", dtype=torch.bfloat16)
    a, (dgu,) = grads_of(triton_kernels.silu_and_mul, gate_up, upstream=da)
    a_ref, (dgu_ref,) = grads_of(kernels.silu_and_mul_torch, gate_up, upstream=da)
    torch.testing.assert_close(a, a_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dgu.float(), dgu_ref.float(), atol=3e-2, rtol=3e-2)


def test_rotary_forward_and_backward_match_torch():
    from tempering.training import triton_kernels

    torch.manual_seed(0)
    qkv = torch.randn(300, 12 * 128 + 2 * 2 * 128, device="cuda", dtype=torch.bfloat16)
    k = qkv[:, 12 * 128: 14 * 128].view(300, 2, 128)  # a strided view, as in the decoder
    angles = torch.rand(300, 64, device="cuda") * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(torch.bfloat16)
    dy = torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16)
    y, (dx,) = grads_of(lambda t: triton_kernels.rotary(t, cos, sin), k, upstream=dy)
    y_ref, (dx_ref,) = grads_of(lambda t: kernels.apply_rotary(t, cos, sin), k, upstream=dy)
    torch.testing.assert_close(y, y_ref, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(dx, dx_ref, atol=3e-2, rtol=2e-2)


def test_logprob_epilogue_matches_torch():
    from tempering.training import triton_kernels

    torch.manual_seed(0)
    logits = torch.randn(33, 151_936, device="cuda", dtype=torch.bfloat16) * 4
    targets = torch.randint(0, 151_936, (33,), device="cuda")
    inv_t = torch.rand(33, device="cuda") + 0.5
    lp_ref, ent_ref, grad_ref = kernels.logprob_epilogue_torch(logits, targets, inv_t, need_grad=True)
    lp, ent, grad = triton_kernels.logprob_epilogue(logits.clone(), targets, inv_t, need_grad=True)
    torch.testing.assert_close(lp, lp_ref, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ent, ent_ref, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(grad.float(), grad_ref, atol=1e-3, rtol=1e-2)


def test_bf16_packed_forward_is_close_to_the_peft_model():
    import transformers

    from tempering.training import TokenizedSequence, Trainer
    from tempering.training.batching import pack_sequences
    from tempering.types import LoRAConfig

    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    trainer = Trainer.new(model, LoRAConfig(rank=8))
    assert trainer.decoder is not None
    g = torch.Generator().manual_seed(1)
    seqs = [TokenizedSequence(torch.randint(0, 1000, (n,), generator=g).tolist(), [False] * 8 + [True] * (n - 8),
                              [float("nan")] * 8 + [-1.0] * (n - 8), advantage=1.0, trajectory_index=i)
            for i, n in enumerate((200, 120, 64))]
    [micro] = pack_sequences(seqs, max_tokens=4096)
    with trainer._forward_mode(checkpointing=True):
        ours, _ = trainer._logprobs(micro, chunk_size=64)
    ref = []
    for s in micro.sequences:
        ids = torch.tensor(s.token_ids, device="cuda")[None]
        logits = trainer.peft_model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
        ref.append(lp[torch.tensor(s.loss_mask[1:], device="cuda")])
    diff = (ours.detach() - torch.cat(ref).detach()).abs()
    assert diff.mean() < 0.02 and diff.max() < 0.2, (diff.mean(), diff.max())
