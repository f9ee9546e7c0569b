import math

import pytest

from tempering.training.advantages import group_advantages


def test_centered_advantages_subtract_the_group_mean():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], normalize=False) == [0.5, -0.5, -0.5, 0.5]


def test_normalized_advantages_divide_by_the_population_std():
    # mean 0.25, population std sqrt(0.1875) = 0.4330127
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], normalize=True, eps=0.0)
    assert adv[0] == pytest.approx(0.75 / math.sqrt(0.1875))
    assert adv[1] == pytest.approx(-0.25 / math.sqrt(0.1875))
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)


def test_zero_spread_group_has_zero_advantages():
    assert group_advantages([0.3, 0.3, 0.3], normalize=True) == [0.0, 0.0, 0.0]
    assert group_advantages([], normalize=True) == []
