"""RLOO advantages against hand-computed values."""

import pytest
import torch

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.rloo import RLOO, RLOOConfig, rloo_advantages

T = torch.tensor


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


def test_rloo_leave_one_out_baseline():
    # [1,0,0,1]: sample 0 baseline mean(0,0,1) = 1/3 -> 2/3; sample 1 baseline mean(1,0,1) = 2/3 -> -2/3
    close(rloo_advantages(T([1.0, 0.0, 0.0, 1.0]), 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # [3,1,2]: 3 - 1.5 = 1.5; 1 - 2.5 = -1.5; 2 - 2 = 0   |  [1,0]: 1 - 0 = 1; 0 - 1 = -1
    close(rloo_advantages(T([3.0, 1.0, 2.0]), 3), [1.5, -1.5, 0.0])
    close(rloo_advantages(T([1.0, 0.0, 5.0, 5.0]), 2), [1.0, -1.0, 0.0, 0.0])


def test_rloo_singleton_and_zero_variance_groups_are_zero():
    close(rloo_advantages(T([1.0, 0.0, 3.0]), 1), [0.0, 0.0, 0.0])
    close(rloo_advantages(T([0.5, 0.5, 0.5, 0.0, 0.0, 0.0]), 3), [0.0] * 6)
    assert rloo_advantages(torch.zeros(0), 4).shape == (0,)  # a rank holding no samples


def test_rloo_bad_shapes_and_registry():
    with pytest.raises(ValueError, match="divisible"):
        rloo_advantages(T([1.0, 0.0, 1.0]), 2)
    assert ADVANTAGES.get("rloo") is RLOO and RLOO.needs_groups
    adv = RLOO.compute(AdvantageInput(T([1.0, 0.0]), torch.ones(2, 3), 2), RLOOConfig())
    close(adv, [1.0, -1.0])
