"""Per-token KL estimators between the policy and a reference policy (Schulman, "Approximating KL
divergence", 2020), evaluated on tokens sampled from the policy.

`KL_ESTIMATORS` names them for `algorithm.kl_estimator`: k1, k2 and k3 here; abs (kl_abs.py); k1+ and k3+, the
straight-through variants (kl_straight_through.py). An estimator is `(logprobs, ref_logprobs) -> per-token KL`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from yatt.registry import Registry

# exp() of a log-ratio beyond this overflows float32/bf16 or dominates the loss; tokens this
# far apart are already maximally penalized, so clamping loses nothing useful.
LOG_RATIO_CLAMP = 20.0
# k3's value is clamped to [-K3_CLAMP, K3_CLAMP] as veRL's `low_var_kl` does. Unclamped, its gradient
# d k3 / d logprob = 1 - exp(-log_ratio) is -2.2e4 at log-ratio -10 and -4.4e8 at -19.9, so one token far
# below the reference would dominate the gradient norm. With the clamp a token contributes gradient only
# while k3 <= 10, i.e. log-ratio in about [-2.61, 11]: |gradient| <= exp(2.61) - 1 = 12.6 per token,
# and 0 beyond (such a token is at the penalty's ceiling; the clipped policy ratio bounds how it moves).
K3_CLAMP = 10.0


def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """log(pi/ref): unbiased but high variance, can be negative per token."""
    return logprobs - ref_logprobs


def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """0.5 * log(pi/ref)^2: biased, low variance, always >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """r - 1 - log r with r = ref/pi: unbiased, low variance, always >= 0.

    Bounded like veRL's `low_var_kl`: the log-ratio is clamped to [-20, 20] before exponentiating
    (numerical safety), then the value to [-10, 10] (which bounds the gradient, see K3_CLAMP).
    """
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: Registry = Registry(
    "algorithm.kl_estimator",
    {
        "k1": k1,
        "k2": k2,
        "k3": k3,
        "abs": "yatt.algorithms.kl_abs:kl_abs",
        "k1+": "yatt.algorithms.kl_straight_through:k1_plus",
        "k3+": "yatt.algorithms.kl_straight_through:k3_plus",
    },
)


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """Look up a KL estimator `(logprobs, ref_logprobs) -> per-token KL` by name (or import path)."""
    return KL_ESTIMATORS.get(name)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || ref) estimate of the given kind (a KL_ESTIMATORS name); same shape as inputs."""
    return get_kl_estimator(kind)(logprobs, ref_logprobs)


def kl_penalized_rewards(rewards: Tensor, kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Sequence rewards [B] minus coef * the summed per-token KL over valid tokens.

    This is KL used as a reward penalty (outcome rewards), as opposed to a KL loss term.
    """
    seq_kl = torch.where(mask.bool(), kl, 0.0).sum(dim=-1)
    return rewards - coef * seq_kl
