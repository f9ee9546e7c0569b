"""The trainer's packed attention: the padded one-call form (float32 on CUDA) equals the per-sequence
form (the CPU's), values and gradients, with grouped-query heads, shared-prompt keys and a window."""

import pytest
import torch

from tempering.training.attention import padded_causal_attention, varlen_causal_attention


@pytest.mark.parametrize("window", [None, 3])
def test_the_padded_attention_equals_one_call_per_sequence(window):
    g = torch.Generator().manual_seed(0)
    # three segments: the first reads only itself, the next two read a shared 4-token prompt first
    own = [5, 3, 6]
    prompt = 4
    T = sum(own) + 2  # two tokens of a row's padding, read by no segment
    q = torch.randn(T, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T + prompt, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T + prompt, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    # keys: segment 0 its own 5 tokens; segments 1 and 2 the prompt (rows T..T+3), then their own
    key_index = torch.cat([torch.arange(0, 5), torch.arange(T, T + prompt), torch.arange(5, 8),
                           torch.arange(T, T + prompt), torch.arange(8, 14)])
    cu_keys = torch.tensor([0, 5, 12, 22], dtype=torch.int32)

    loop = varlen_causal_attention(q, k, v, cu, None, 0.3, window=window, keys=(key_index, cu_keys, 10))
    padded = padded_causal_attention(q, k[key_index], v[key_index], cu, cu_keys, 0.3, window=window)
    assert padded.shape == (T, 4, 8)
    torch.testing.assert_close(padded[:14], loop, rtol=1e-12, atol=1e-12)
    assert padded[14:].abs().max() == 0
    weights = torch.randn(14, 4, 8, generator=g, dtype=torch.float64)
    grads_loop = torch.autograd.grad((loop * weights).sum(), (q, k, v))
    grads_padded = torch.autograd.grad((padded[:14] * weights).sum(), (q, k, v))
    for a, b in zip(grads_loop, grads_padded):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_padded_attention_groups_sequences_of_very_different_lengths():
    """Lengths 1 to 300 (four length groups) and an empty segment: the same as one call per sequence."""
    g = torch.Generator().manual_seed(1)
    lens = [300, 1, 0, 17, 130, 2, 64, 65]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(T, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    loop = varlen_causal_attention(q, k, v, cu, None, None)
    torch.testing.assert_close(padded_causal_attention(q, k, v, cu, cu, None), loop, rtol=1e-12, atol=1e-12)
