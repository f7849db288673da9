"""OPO advantages (length-weighted group baseline) against hand-computed values."""

import pytest
import torch

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.opo import OPO, OPOConfig, opo_advantages

T = torch.tensor


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


def test_baseline_is_the_length_weighted_group_mean():
    # group [1, 0], lengths [2, 6]: b = (2*1 + 6*0)/8 = .25 -> [.75, -.25]
    # group [0, 1], lengths [1, 3]: b = 3/4 -> [-.75, .25]
    close(opo_advantages(T([1.0, 0.0, 0.0, 1.0]), T([2, 6, 1, 3]), 2), [0.75, -0.25, -0.75, 0.25])
    # equal lengths: the plain mean (GRPO without the std): [3, 1, 2] - 2
    close(opo_advantages(T([3.0, 1.0, 2.0]), T([4, 4, 4]), 3), [1.0, -1.0, 0.0])


def test_empty_responses_singletons_and_equal_rewards():
    close(opo_advantages(T([1.0, 0.0]), T([0, 0]), 2), [0.5, -0.5])  # no tokens at all: the plain mean
    close(opo_advantages(T([1.0, 0.0]), T([3, 5]), 1), [0.0, 0.0])  # its own reward is its baseline
    close(opo_advantages(T([0.5, 0.5]), T([1, 9]), 2), [0.0, 0.0])
    assert opo_advantages(torch.zeros(0), torch.zeros(0), 4).shape == (0,)  # a rank holding no samples
    with pytest.raises(ValueError, match="divisible"):
        opo_advantages(T([1.0, 0.0, 1.0]), T([1, 1, 1]), 2)


def test_the_estimator_reads_lengths_from_the_mask():
    assert ADVANTAGES.get("opo") is OPO and OPO.needs_groups
    mask = T([[1, 1, 0, 0], [1, 1, 1, 1]])  # lengths 2 and 4: b = (2*1 + 4*0)/6 = 1/3
    close(OPO.compute(AdvantageInput(T([1.0, 0.0]), mask, 2), OPOConfig()), [2 / 3, -1 / 3])
