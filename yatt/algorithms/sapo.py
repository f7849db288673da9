"""SAPO's policy loss (Qwen 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a smooth gate in place
of PPO's hard clip."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.aggregation import clamped_log_ratio, masked_mean, per_token
from yatt.algorithms.base import ComponentConfig, PolicyLoss


class SAPOConfig(ComponentConfig):
    kind: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0.0, description="Gate temperature of sequences with a positive advantage.")
    tau_neg: float = Field(
        1.05, gt=0.0, description="Gate temperature of the others; above tau_pos: their off-policy tokens fade faster."
    )


def sapo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: SAPOConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token -f(r) * A with the gate f(r) = (4 / tau) * sigmoid(tau * (r - 1)), r = exp(logprob - old_logprob).

    tau is tau_pos for a sequence whose advantage (its tokens' mean) is positive, else tau_neg. At r = 1 the
    gate's slope is 1, so an on-policy token's gradient is the policy gradient's; as r moves away the gradient
    fades smoothly (sigmoid'), where PPO's stops at the clip. Stats: ratio_mean, approx_kl (k1), gate_mean.
    """
    advantages = per_token(advantages, logprobs)
    valid = mask.bool()
    log_ratio = clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    positive = masked_mean(advantages, valid, dim=-1) > 0
    tau = torch.where(positive, cfg.tau_pos, cfg.tau_neg).to(logprobs.dtype).unsqueeze(-1)
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
    loss = torch.where(valid, -gate * advantages, 0.0)
    with torch.no_grad():
        stats = {
            "ratio_mean": masked_mean(ratio, valid),
            "approx_kl": masked_mean(-log_ratio, valid),
            "gate_mean": masked_mean(gate, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


SAPO = PolicyLoss(config=SAPOConfig, compute=sapo_loss, stats=("ratio_mean", "approx_kl", "gate_mean"))
