import math

import pytest
import torch

from tempering.training.losses import kl_estimate, policy_loss, sequence_mean, token_weights
from tempering.training.tokenize import TokenizedSequence


def _loss(new, old, adv, fn="ppo", lo=0.2, hi=0.2, **kw):
    return policy_loss(torch.tensor(new), torch.tensor(old), torch.tensor(adv), loss_fn=fn, clip_low=lo, clip_high=hi, **kw)


def test_ppo_on_policy_loss_is_minus_advantage_and_gradient_is_minus_advantage():
    new = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, clipped, ratio = policy_loss(new, new.detach().clone(), torch.tensor([2.0, -1.0]), loss_fn="ppo", clip_low=0.2, clip_high=0.2)
    assert loss.tolist() == pytest.approx([-2.0, 1.0])
    assert not clipped.any() and ratio.tolist() == [1.0, 1.0]
    loss.sum().backward()
    assert new.grad.tolist() == pytest.approx([-2.0, 1.0])  # d/dlogp of -ratio*A at ratio 1 is -A


def test_ppo_clips_a_large_ratio_with_positive_advantage():
    loss, clipped, _ = _loss([0.5], [0.0], [1.0])  # ratio e^0.5 = 1.6487 > 1.2
    assert loss.item() == pytest.approx(-1.2)
    assert clipped.item()


def test_ppo_keeps_unclipped_term_when_it_is_smaller():
    loss, _, _ = _loss([-0.5], [0.0], [1.0])  # ratio 0.6065 < 0.8 with A=+1: min(0.6065, 0.8)
    assert loss.item() == pytest.approx(-math.exp(-0.5))
    loss, _, _ = _loss([0.5], [0.0], [-1.0])  # A=-1, ratio 1.6487: min(-1.6487, -1.2)
    assert loss.item() == pytest.approx(math.exp(0.5))


def test_ppo_clip_higher_uses_the_high_epsilon_above_one():
    loss, _, _ = _loss([0.5], [0.0], [1.0], lo=0.2, hi=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_cispo_weights_logprob_by_detached_clipped_ratio():
    new = torch.tensor([0.5 - 2.0], requires_grad=True)  # ratio e^0.5 against old -2.0
    loss, clipped, _ = policy_loss(new, torch.tensor([-2.0]), torch.tensor([1.0]), loss_fn="cispo", clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2 * (-1.5))
    loss.backward()
    assert new.grad.item() == pytest.approx(-1.2)  # the gradient flows through logprob even when clipped
    assert clipped.item()


def test_gspo_uses_the_geometric_mean_ratio_of_each_sequence():
    # sequence 0: log ratios 0.1, -0.3 -> mean -0.1; sequence 1: 0.02 -> mean 0.02
    new = torch.tensor([0.1, -0.3, 0.02], requires_grad=True)
    seq_index = torch.tensor([0, 0, 1])
    loss, clipped, ratio = policy_loss(new, torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]), loss_fn="gspo",
                                       clip_low=0.2, clip_high=0.2, seq_index=seq_index, num_seqs=2)
    s0, s1 = math.exp(-0.1), math.exp(0.02)
    assert ratio.tolist() == pytest.approx([s0, s0, s1])
    assert loss.tolist() == pytest.approx([-s0, -s0, s1])
    loss.sum().backward()
    # d(-s0)/d new_0 = -s0 * 1/2 for each of the two tokens of sequence 0, which both carry -s0
    assert new.grad[0].item() == pytest.approx(2 * -s0 / 2)
    assert not clipped.any()


def test_sequence_mean_broadcasts_each_sequences_mean():
    out = sequence_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), 2)
    assert out.tolist() == [2.0, 2.0, 5.0]


def test_kl_estimators_match_their_formulas():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = ref - logp  # [-0.5, 1.0]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx((torch.exp(d) - 1 - d).tolist())
    assert kl_estimate(ref, ref, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_token_weights_for_each_aggregation():
    def s(k):
        return TokenizedSequence([0] * (k + 1), [False] + [True] * k, [float("nan")] + [-1.0] * k)

    seqs = [s(2), s(6)]
    assert token_weights(seqs, "token_mean", None) == [1 / 8, 1 / 8]
    assert token_weights(seqs, "sequence_mean", None) == [1 / 4, 1 / 12]
    assert token_weights(seqs, "dr_grpo", None) == [1 / 12, 1 / 12]  # 2 sequences x longest (6)
    assert token_weights(seqs, "dr_grpo", 10) == [1 / 20, 1 / 20]


def test_unknown_loss_fn_is_rejected():
    with pytest.raises(ValueError, match="unknown loss_fn"):
        policy_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), loss_fn="grpo++", clip_low=0.2, clip_high=0.2)


def _objective(new_values, sampled, advantages, **config):
    from types import SimpleNamespace

    from tempering.training.objective import rl_objective
    from tempering.types import TrainConfig

    new = torch.tensor(new_values, requires_grad=True)
    n = len(new_values)
    row = SimpleNamespace(valid=torch.ones(n, dtype=torch.bool), exact_logprobs=None, sampled_logprobs=torch.tensor(sampled),
                          advantages=torch.tensor(advantages), seq_index=torch.zeros(n, dtype=torch.long), num_seqs=1,
                          weights=torch.full((n,), 1.0 / n))
    loss, _ = rl_objective(lambda row, chunk, lora=True: (new, torch.zeros(n)), row, TrainConfig(**config))
    loss.backward()
    return loss.item(), new.grad


def test_decoupled_equals_ppo_on_fresh_data():
    lp = [-1.0, -2.0, -0.5]
    ppo = _objective(lp, lp, [1.0, -1.0, 0.5])
    decoupled = _objective(lp, lp, [1.0, -1.0, 0.5], decoupled=True)
    assert ppo[0] == pytest.approx(decoupled[0]) and torch.allclose(ppo[1], decoupled[1])


def test_decoupled_keeps_the_gradient_of_a_stale_token_that_ppo_clips():
    # the policy moved since sampling: ratio 1.5 > 1 + 0.2 with a positive advantage
    new, sampled = [math.log(0.6)], [math.log(0.4)]
    _, ppo_grad = _objective(new, sampled, [1.0])
    _, grad = _objective(new, sampled, [1.0], decoupled=True)
    assert ppo_grad.item() == 0.0  # PPO: clipped against the sampling policy, no gradient
    assert grad.item() == pytest.approx(-1.5)  # -A * (π_prox / π_sampled) = -1 * 1.5
    _, capped = _objective([math.log(0.9)], [math.log(0.1)], [1.0], decoupled=True)
    assert capped.item() == pytest.approx(-2.0)  # the weight capped at 2 (truncated_importance_sampling unset)
    _, capped = _objective([math.log(0.9)], [math.log(0.1)], [1.0], decoupled=True, truncated_importance_sampling=3.0)
    assert capped.item() == pytest.approx(-3.0)
