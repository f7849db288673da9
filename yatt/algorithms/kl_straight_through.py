"""Straight-through KL estimators `k1+` and `k3+`: the value of k1 (resp. k3), the gradient of k2.

k1 and k3 are unbiased estimates of KL(pi || ref) as values, but as losses their gradients are not the
gradient of that KL: under the policy's own samples E[grad k1] = E[grad log pi] = 0, and k3's gradient
(1 - ref/pi) * grad log pi has the expectation of the reverse KL's. k2 = 0.5 * log(pi/ref)^2 has the gradient
log(pi/ref) * grad log pi, whose expectation is grad KL(pi || ref). The "+" estimators keep the value (what the
loss reports) and take k2's gradient: value = k2 + (k1 - k2).detach(), as veRL's `k1+` / `low_var_kl+` do.
"""

from __future__ import annotations

from torch import Tensor

from yatt.algorithms.kl import k1, k2, k3


def _straight_through(value: Tensor, gradient_of: Tensor) -> Tensor:
    """`value` forward, the gradient of `gradient_of` backward."""
    return gradient_of + (value - gradient_of).detach()


def k1_plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1's value log(pi/ref), k2's gradient."""
    return _straight_through(k1(logprobs, ref_logprobs), k2(logprobs, ref_logprobs))


def k3_plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3's (clamped) value, k2's gradient (unclamped: it grows only linearly in the log ratio)."""
    return _straight_through(k3(logprobs, ref_logprobs), k2(logprobs, ref_logprobs))
