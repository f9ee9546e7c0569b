import torch

from tempering.engine.sampler import sample
from tempering.engine.sampling_params import SamplingParams


def test_greedy_rows_take_the_argmax_and_report_temperature_one_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None])
    assert out.token_ids.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(out.logprobs, expected)


def test_logprobs_are_at_the_sampling_temperature():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    out = sample(logits, [SamplingParams(temperature=0.5)], [g])
    expected = torch.log_softmax(logits / 0.5, -1)[0, out.token_ids[0]]
    assert torch.allclose(out.logprobs[0], expected)


def test_same_seed_same_tokens_and_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    a = sample(logits, params, [None] * 4000, torch.Generator().manual_seed(1)).token_ids
    b = sample(logits, params, [None] * 4000, torch.Generator().manual_seed(1)).token_ids
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.03)


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(500, 1)
    top_k = sample(logits, [SamplingParams(top_k=2)] * 500, [None] * 500, torch.Generator().manual_seed(0)).token_ids
    assert set(top_k.tolist()) == {0, 1}
    # top_p 0.7: keep 0.5 and the token that crosses 0.7 (0.3)
    top_p = sample(logits, [SamplingParams(top_p=0.7)] * 500, [None] * 500, torch.Generator().manual_seed(0)).token_ids
    assert set(top_p.tolist()) == {0, 1}


def test_top_logprobs_are_the_most_likely_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, num_top_logprobs=2)], [None])
    assert out.top_ids.tolist() == [[1, 3]]
