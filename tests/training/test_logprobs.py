import torch

from tempering.training.logprobs import selective_logprobs


def test_chunked_logprobs_equal_full_logits_logprobs_with_gradients():
    torch.manual_seed(0)
    N, H, V = 37, 16, 101
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    temperature = torch.full((N,), 0.7)
    lp, entropy = selective_logprobs(hidden, weight, targets, temperature, chunk_size=8)

    hidden_ref = hidden.detach().clone().requires_grad_(True)
    weight_ref = weight.detach().clone().requires_grad_(True)
    full = torch.log_softmax(hidden_ref @ weight_ref.T / 0.7, dim=-1)
    lp_ref = full.gather(1, targets[:, None]).squeeze(1)
    ent_ref = -(full.exp() * full).sum(-1)
    assert torch.allclose(lp, lp_ref, atol=1e-5)
    assert torch.allclose(entropy, ent_ref, atol=1e-4)

    lp.sum().backward()
    lp_ref.sum().backward()
    assert torch.allclose(hidden.grad, hidden_ref.grad, atol=1e-5)
    assert torch.allclose(weight.grad, weight_ref.grad, atol=1e-5)
