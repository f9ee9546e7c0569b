"""Mixture-of-experts math (modeling/experts.py) and the routed-experts wire format (modeling/routing_format.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tempering.modeling.experts import ExpertLoRA, MoEDelta, grouped_linear, route, sort_by_expert, sparse_moe
from tempering.modeling.routing_format import decode_routed_experts, encode_routed_experts

E, K = 8, 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[:, :half]) * x[:, half:]


def test_grouped_gemm_and_the_per_expert_loop_agree_with_per_token_matmuls_in_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, E, (13, K), generator=g)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, E - 1, (13,), generator=g)) % E  # k distinct experts per token
    ids[ids == 5] = 6  # an expert with no token
    x = torch.randn(13 * K, 16, generator=g)
    w = torch.randn(E, 24, 16, generator=g)
    batch = sort_by_expert(ids, E, host_counts=True)
    assert batch.counts[5] == 0 and sum(batch.counts) == 13 * K
    flat = ids.reshape(-1)
    assert torch.equal(flat[batch.inverse.argsort()], flat.sort(stable=True).values)  # rows grouped by expert
    xs = x[batch.inverse.argsort()]  # any per-row input, in sorted order
    per_row = torch.stack([w[e] @ row for e, row in zip(flat.sort(stable=True).values, xs)])
    outs = {}
    for impl in ("grouped_mm", "loop"):
        xi, wi = xs.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_linear(xi, wi, batch, impl=impl)
        torch.testing.assert_close(y, per_row, atol=1e-5, rtol=1e-5)
        y.backward(torch.ones_like(y))
        outs[impl] = (xi.grad, wi.grad)
    for a, b in zip(outs["grouped_mm"], outs["loop"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sparse_moe_block_equals_transformers_and_replay_routes_to_the_given_experts():
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=E, num_experts_per_tok=K,
                                         norm_topk_prob=True)
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    h = torch.randn(11, 32)
    with torch.no_grad():
        expected = block(h[None])[0]
        for impl in ("grouped_mm", "loop"):
            out, ids = sparse_moe(h, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, top_k=K,
                                  normalize=True, silu_and_mul=silu_and_mul, impl=impl)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        # replay: the given experts, weighted by this router's probabilities renormalized over them
        replay = torch.tensor([[7, 3]] * 11)
        replay[0] = -1  # a token without a recorded route keeps its own
        weights, used = route(h @ block.gate.weight.T, K, True, replay)
        assert torch.equal(used[1:], replay[1:]) and torch.equal(used[0], ids[0])
        probs = torch.softmax(h @ block.gate.weight.T, -1)[1:, [7, 3]]
        torch.testing.assert_close(weights[1:], probs / probs.sum(-1, keepdim=True))


def test_expert_lora_stacks_peft_layout_per_expert_and_pads_the_rank_to_a_multiple_of_8():
    r, out, inp = 3, 10, 6
    A = torch.randn(E * r, inp)  # PEFT: rows e·r .. (e+1)·r are expert e's A
    B = torch.randn(out, r * E)  # PEFT: column j·E + e is expert e's B[:, j]
    lora = ExpertLoRA(A, B, E, scale=0.5)
    A_s, B_s = lora.stacked(torch.float32)
    assert A_s.shape == (E, 8, inp) and B_s.shape == (E, out, 8)
    for e in range(E):
        expected = 0.5 * B.view(out, r, E)[:, :, e] @ A[e * r:(e + 1) * r]  # PEFT's get_delta_weight, expert e
        torch.testing.assert_close(B_s[e] @ A_s[e], expected)
    h = torch.randn(5, inp)
    gate_up, down = torch.randn(E, 2 * 4, inp), torch.randn(E, inp, 4)
    router = torch.randn(E, inp)
    base, _ = sparse_moe(h, router, gate_up, down, top_k=K, normalize=True, silu_and_mul=silu_and_mul)
    merged, _ = sparse_moe(h, router, gate_up, down + torch.stack([B_s[e, :inp] @ A_s[e, :, :4] for e in range(E)]),
                           top_k=K, normalize=True, silu_and_mul=silu_and_mul)
    shrink, expand = A_s[:, :, :4].contiguous(), B_s[:, :inp].contiguous()
    lora_out, _ = sparse_moe(h, router, gate_up, down, top_k=K, normalize=True, silu_and_mul=silu_and_mul,
                             deltas=[MoEDelta(None, (shrink, expand))])
    torch.testing.assert_close(lora_out, merged, atol=1e-5, rtol=1e-5)  # LoRA = merged weights
    assert not torch.allclose(lora_out, base)


def test_routed_experts_round_trip_through_json_compactly():
    ids = np.random.default_rng(0).integers(0, 128, (37, 48, 8)).astype(np.uint8)
    encoded = encode_routed_experts(ids)
    assert encoded["dtype"] == "uint8" and encoded["shape"] == [37, 48, 8]
    assert len(encoded["data"]) < 1.4 * ids.size  # base64 of one byte per id
    decoded = decode_routed_experts(encoded)
    assert decoded.dtype == np.int16 and np.array_equal(decoded, ids)
    wide = np.random.default_rng(1).integers(0, 300, (5, 2, 4)).astype(np.int16)  # > 256 experts
    assert np.array_equal(decode_routed_experts(encode_routed_experts(wide)), wide)
    assert np.array_equal(decode_routed_experts(ids.tolist()), ids)  # nested lists are accepted too
    with pytest.raises(ValueError):
        decode_routed_experts({**encoded, "shape": [36, 48, 8]})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_on_cuda_matches_the_cpu_twin_in_bf16():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (512, 8), generator=g)
    h = torch.randn(512, 256, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(128, 2 * 64, 256, generator=g) * 0.05).to(torch.bfloat16)
    batch = sort_by_expert(ids, 128, host_counts=True)
    xs = h[batch.token]
    cpu = grouped_linear(xs.float(), gate_up.float(), batch, impl="loop")
    batch_cuda = sort_by_expert(ids.cuda(), 128, host_counts=False)
    cuda = grouped_linear(xs.cuda(), gate_up.cuda(), batch_cuda, impl="auto")  # grouped_mm
    torch.testing.assert_close(cuda.float().cpu(), cpu, atol=3e-2, rtol=3e-2)
