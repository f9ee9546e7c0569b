import math

import pytest
import torch

from tempering.training.losses import policy_loss


def _ppo(new, old, adv, lo=0.2, hi=0.2):
    return policy_loss(torch.tensor(new), torch.tensor(old), torch.tensor(adv), loss_fn="ppo", clip_low=lo, clip_high=hi)


def test_ppo_on_policy_loss_is_minus_advantage_and_gradient_is_minus_advantage():
    new = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, clipped = policy_loss(new, new.detach().clone(), torch.tensor([2.0, -1.0]), loss_fn="ppo", clip_low=0.2, clip_high=0.2)
    assert loss.tolist() == pytest.approx([-2.0, 1.0])
    assert not clipped.any()
    loss.sum().backward()
    # d/dlogp of -ratio*A at ratio 1 is -A
    assert new.grad.tolist() == pytest.approx([-2.0, 1.0])


def test_ppo_clips_a_large_ratio_with_positive_advantage():
    # ratio = e^0.5 = 1.6487 > 1.2: the clipped term 1.2 * A is the minimum
    loss, clipped = _ppo([0.5], [0.0], [1.0])
    assert loss.item() == pytest.approx(-1.2)
    assert clipped.item()


def test_ppo_keeps_unclipped_term_when_it_is_smaller():
    # ratio = e^-0.5 = 0.6065 < 0.8 with A = +1: min(0.6065, 0.8) = 0.6065
    loss, _ = _ppo([-0.5], [0.0], [1.0])
    assert loss.item() == pytest.approx(-math.exp(-0.5))
    # negative advantage, ratio 1.6487: min(-1.6487, -1.2) = -1.6487 -> loss 1.6487
    loss, _ = _ppo([0.5], [0.0], [-1.0])
    assert loss.item() == pytest.approx(math.exp(0.5))


def test_ppo_clip_higher_uses_the_high_epsilon_above_one():
    loss, _ = _ppo([0.5], [0.0], [1.0], lo=0.2, hi=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_cispo_weights_logprob_by_detached_clipped_ratio():
    new = torch.tensor([0.5 - 2.0], requires_grad=True)  # ratio e^0.5 against old -2.0
    loss, clipped = policy_loss(new, torch.tensor([-2.0]), torch.tensor([1.0]), loss_fn="cispo", clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2 * (-1.5))
    loss.backward()
    assert new.grad.item() == pytest.approx(-1.2)  # gradient flows through logprob even when clipped
    assert clipped.item()


def test_unknown_loss_fn_is_rejected():
    with pytest.raises(ValueError, match="unknown loss_fn"):
        policy_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), loss_fn="grpo++", clip_low=0.2, clip_high=0.2)
