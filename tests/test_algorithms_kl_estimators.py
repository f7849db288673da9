"""The abs, k1+ and k3+ KL estimators: values and gradients against hand-computed numbers."""

import math

import pytest
import torch

from yatt.algorithms import KL_ESTIMATORS, kl_estimate

T = torch.tensor


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


def value_and_grad(kind: str, log_ratios: list[float]):
    """(estimate, d sum(estimate) / d logprobs) with ref log-probs 0, so logprobs are the log ratios."""
    lp = T(log_ratios, requires_grad=True)
    kl = kl_estimate(lp, torch.zeros(len(log_ratios)), kind)
    kl.sum().backward()
    return kl.detach(), lp.grad


def test_abs_is_the_absolute_log_ratio_with_sign_gradient():
    value, grad = value_and_grad("abs", [0.5, -2.0])
    close(value, [0.5, 2.0])
    close(grad, [1.0, -1.0])


def test_k1_plus_has_k1s_value_and_k2s_gradient():
    value, grad = value_and_grad("k1+", [0.5, -2.0])
    close(value, [0.5, -2.0])  # k1 = log ratio
    close(grad, [0.5, -2.0])  # d/dx 0.5 x^2 = x
    _, k1_grad = value_and_grad("k1", [0.5, -2.0])
    close(k1_grad, [1.0, 1.0])  # what k1 alone would push


def test_k3_plus_has_k3s_value_and_k2s_gradient():
    value, grad = value_and_grad("k3+", [1.0, -1.0, -10.0])
    # k3 = e^-x - 1 + x: x=1 -> .36787944; x=-1 -> e - 2 = .71828183; x=-10 -> e^10 - 11, clamped to 10
    close(value, [math.exp(-1.0), math.e - 2.0, 10.0])
    close(grad, [1.0, -1.0, -10.0])  # k2's gradient, even where k3's clamp has none


def test_the_new_estimators_are_registered_and_zero_at_equal_policies():
    assert {"abs", "k1+", "k3+"} <= set(KL_ESTIMATORS)
    x = T([-0.3, -2.0])
    for kind in ("abs", "k1+", "k3+"):
        close(kl_estimate(x, x, kind), [0.0, 0.0])
    with pytest.raises(ValueError, match="algorithm.kl_estimator 'k5'; registered: abs, k1, k1\\+"):
        kl_estimate(x, x, "k5")
