"""The `abs` KL estimator: |log(pi/ref)| per token.

Unlike k1 it cannot go negative per token, so tokens that moved below the reference do not cancel tokens
that moved above it in a sequence's sum; its gradient, sign(log ratio) * grad log pi, has constant magnitude
(veRL's `abs` kl_penalty).
"""

from __future__ import annotations

from torch import Tensor


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|logprobs - ref_logprobs|, elementwise."""
    return (logprobs - ref_logprobs).abs()
