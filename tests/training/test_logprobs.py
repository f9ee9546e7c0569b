import pytest
import torch

from tempering.training.kernels import logprob_epilogue_torch
from tempering.training.logprobs import selective_logprobs


def reference(hidden, weight, targets, temperature):
    full = torch.log_softmax(hidden @ weight.T / temperature[:, None], dim=-1)
    return full.gather(1, targets[:, None]).squeeze(1), -(full.exp() * full).sum(-1)


def test_chunked_logprobs_equal_full_logits_logprobs_with_gradients():
    torch.manual_seed(0)
    N, H, V = 37, 16, 101
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H)
    targets = torch.randint(0, V, (N,))
    temperature = torch.rand(N) + 0.5  # a temperature per token
    upstream = torch.randn(N)  # any loss built on the logprobs
    lp, entropy = selective_logprobs(hidden, weight, targets, temperature, chunk_size=8)

    hidden_ref = hidden.detach().clone().requires_grad_(True)
    lp_ref, ent_ref = reference(hidden_ref, weight, targets, temperature)
    assert torch.allclose(lp, lp_ref, atol=1e-5)
    assert torch.allclose(entropy, ent_ref, atol=1e-4)
    assert not entropy.requires_grad

    (lp * upstream).sum().backward()
    (lp_ref * upstream).sum().backward()
    assert torch.allclose(hidden.grad, hidden_ref.grad, atol=1e-5)


def test_without_grad_no_gradient_is_computed_and_a_trainable_lm_head_is_refused():
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8)
    targets, temperature = torch.randint(0, 11, (5,)), torch.ones(5)
    with torch.no_grad():
        lp, _ = selective_logprobs(hidden, weight, targets, temperature)
    assert not lp.requires_grad
    assert torch.allclose(lp, reference(hidden.detach(), weight, targets, temperature)[0], atol=1e-5)
    with pytest.raises(ValueError, match="frozen"):
        selective_logprobs(hidden, weight.requires_grad_(True), targets, temperature)


def test_epilogue_gradient_is_onehot_minus_softmax_over_temperature():
    torch.manual_seed(0)
    logits, targets, inv_t = torch.randn(4, 9), torch.tensor([0, 3, 8, 3]), torch.tensor([1.0, 2.0, 0.5, 1.25])
    _, _, grad = logprob_epilogue_torch(logits.clone(), targets, inv_t, need_grad=True)
    z = (logits * inv_t[:, None]).requires_grad_(True)
    torch.log_softmax(z, -1).gather(1, targets[:, None]).sum().backward()
    assert torch.allclose(grad, z.grad * inv_t[:, None], atol=1e-6)
