import pytest
import torch

from tempering.engine.sampler import gumbel_sample_reference, hash_uniform, sample, sampling_tensors
from tempering.engine.sampling_params import SamplingParams


def _options(params, seeds=None, counters=None):
    B = len(params)
    return sampling_tensors(params, seeds or list(range(B)), counters or [0] * B, torch.device("cpu"))


def test_greedy_rows_take_the_argmax_and_report_temperature_one_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    out = sample(logits, _options([SamplingParams(temperature=0.0)] * 2))
    assert out.token_ids.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(out.logprobs, expected)


def test_logprobs_are_at_the_sampling_temperature():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = sample(logits, _options([SamplingParams(temperature=0.5)]))
    expected = torch.log_softmax(logits / 0.5, -1)[0, out.token_ids[0]]
    assert torch.allclose(out.logprobs[0], expected)


def test_same_seed_and_counter_give_the_same_token_whatever_the_batch():
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=1.0)] * 6
    full = sample(logits, _options(params, seeds=[7, 8, 9, 10, 11, 12], counters=[3] * 6)).token_ids
    alone = sample(logits[2:3], _options(params[:1], seeds=[9], counters=[3])).token_ids
    assert full[2] == alone[0]


def test_frequencies_follow_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().repeat(6000, 1)
    out = sample(logits, _options([SamplingParams(temperature=1.0)] * 6000, seeds=list(range(6000)))).token_ids
    freq = torch.bincount(out, minlength=3).float() / 6000
    assert torch.allclose(freq, probs, atol=0.025)


def test_hash_uniform_is_uniform_and_depends_on_seed_and_counter():
    u = hash_uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / 20000
    assert torch.all((hist - 0.1).abs() < 0.01)
    v = hash_uniform(torch.zeros(20000, dtype=torch.long), torch.arange(20000))
    assert abs(v.mean().item() - 0.5) < 0.01
    assert not torch.equal(u, v)


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(500, 1)
    top_k = sample(logits, _options([SamplingParams(top_k=2)] * 500)).token_ids
    assert set(top_k.tolist()) == {0, 1}
    # top_p 0.7: keep 0.5 and the token that crosses 0.7 (0.3)
    top_p = sample(logits, _options([SamplingParams(top_p=0.7)] * 500)).token_ids
    assert set(top_p.tolist()) == {0, 1}
    # rows without truncation in the same batch still reach every token
    mixed = sample(logits, _options([SamplingParams(top_k=1)] * 250 + [SamplingParams()] * 250)).token_ids
    assert set(mixed[:250].tolist()) == {0} and set(mixed[250:].tolist()) == {0, 1, 2, 3}


def test_top_logprobs_are_the_most_likely_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = sample(logits, _options([SamplingParams(temperature=0.0, num_top_logprobs=2)]))
    assert out.top_ids.tolist() == [[1, 3]]


def test_gumbel_max_samples_follow_the_distribution_at_the_row_temperature():
    """The twin of the fused GPU sampler draws from softmax(logits / T) and returns that logprob."""
    probs = torch.tensor([0.1, 0.6, 0.3])
    n = 8000
    logits = (probs.log() * 0.5).repeat(n, 1)  # at T = 0.5 the distribution is `probs` again
    temperature = torch.full((n,), 0.5)
    ids, lps = gumbel_sample_reference(logits, temperature, torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(ids, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.02)
    assert torch.allclose(lps, probs.log()[ids], atol=1e-5)


def test_gumbel_max_greedy_rows_and_batch_invariance():
    logits = torch.randn(5, 300)
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.7])
    seeds, counters = torch.tensor([4, 5, 6, 7, 8]), torch.tensor([0, 1, 2, 3, 4])
    ids, lps = gumbel_sample_reference(logits, temperature, seeds, counters)
    assert ids[0] == logits[0].argmax() and ids[3] == logits[3].argmax()
    assert torch.allclose(lps[0], torch.log_softmax(logits[0], -1)[ids[0]])
    alone, _ = gumbel_sample_reference(logits[2:3], temperature[2:3], seeds[2:3], counters[2:3])
    assert alone[0] == ids[2]
    other, _ = gumbel_sample_reference(logits[1:2].repeat(64, 1), temperature[1:2].repeat(64), torch.arange(64),
                                       torch.ones(64, dtype=torch.long))
    assert len(set(other.tolist())) > 10  # different seeds draw different tokens


def _unmix32(h: int) -> int:
    """The inverse of murmur3's 32-bit finalizer (sampler._mix32)."""
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & m
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & m
    return h ^ (h >> 16)


def _seed_with_top_hash(token: int) -> int:
    """A row seed whose hash for `token` at counter 0 is 2^32 - 1 (the kernel's chain of finalizers, inverted)."""
    h2 = _unmix32(0xFFFFFFFF) ^ token  # counter 0: h2 = mix(h1 ^ 0)
    return _unmix32(_unmix32(h2)) ^ 0x9E3779B9


def test_gumbel_max_never_draws_a_token_the_distribution_excludes_from_an_extreme_hash():
    """A hash at the top of its range must not give an infinite Gumbel (a uniformly random token).

    The row's seed is chosen so that token 7's hash is 2^32 - 1 (murmur3's finalizer is a
    bijection). Token 7 has probability ~e^-60: it may not be drawn, and the noise stays finite.
    """
    from tempering.engine.sampler import _MASK32, _mix32, gumbel_noise

    token = 7
    seed = _seed_with_top_hash(token)
    h = _mix32(_mix32(_mix32(torch.tensor([seed]) ^ 0x9E3779B9) ^ 0)[:, None] ^ torch.arange(16)[None, :])
    assert int(h[0, token]) == 0xFFFFFFFF  # the crafted seed hits the top of the range
    logits = torch.zeros(1, 16)
    logits[0, token] = -60.0
    ids, _ = gumbel_sample_reference(logits, torch.ones(1), torch.tensor([seed]), torch.zeros(1, dtype=torch.long))
    assert ids.item() != token
    extremes = torch.cat([torch.arange(0, 4096), _MASK32 - torch.arange(0, 4096)])
    noise = gumbel_noise(extremes)
    assert torch.isfinite(noise).all() and noise.max() < 17 and noise.min() > -3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_sampler_draws_no_token_outside_the_distribution():
    """No hash may give an infinite Gumbel: 16,384 rows of a 152k vocabulary where one token has
    all the mass but ~1.4e-8 draw only that token (before the fix, ~0.45% of rows drew a
    uniformly random one), and the crafted worst-case hash of test_sampler does not win."""
    from tempering.engine.layers.triton_sampler import gumbel_sample

    B, V = 4096, 151936
    logits = torch.full((B, V), -30.0, device="cuda", dtype=torch.bfloat16)
    logits[:, 3] = 0.0
    temperature = torch.ones(B, device="cuda")
    off = 0
    for counter in range(4):
        ids, _, _ = gumbel_sample(logits, temperature, torch.arange(B, device="cuda"),
                                  torch.full((B,), counter, device="cuda"))
        off += int((ids != 3).sum())
    assert off == 0
    token = 7
    seed = _seed_with_top_hash(token)
    logits = torch.zeros(1, 16, device="cuda")
    logits[0, token] = -60.0
    ids, _, _ = gumbel_sample(logits, torch.ones(1, device="cuda"), torch.tensor([seed], device="cuda"),
                              torch.zeros(1, dtype=torch.long, device="cuda"))
    assert ids.item() != token
