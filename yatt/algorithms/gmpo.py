"""GMPO's policy loss (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): the geometric
mean of a sequence's token ratios, each clipped in log space."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.aggregation import masked_mean, per_token
from yatt.algorithms.base import ComponentConfig, PolicyLoss


class GMPOConfig(ComponentConfig):
    kind: Literal["gmpo"] = "gmpo"
    clip_low: float = Field(0.4, gt=0.0, description="Log-ratio floor -clip_low (the paper's 0.4: r >= e^-0.4).")
    clip_high: float = Field(0.4, gt=0.0, description="Log-ratio ceiling clip_high (r <= e^0.4).")


def gmpo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: GMPOConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sequence -A * exp(mean_t clip_t), on each of the sequence's tokens.

    Each token's log-ratio l = logprob - old_logprob is clipped pessimistically for the sign of A (as PPO
    clips: sign(A) * min(sign(A) * l, sign(A) * clamp(l, -clip_low, clip_high))); the sequence's ratio is the
    exp of their mean, and A the mean of its tokens' advantages. The loss is one number per sequence, put on
    each of its tokens: with loss_agg=seq-mean-token-mean it is GMPO's mean over sequences (veRL's
    geo_mean). A sequence without response tokens gets 0. Stats: clip_frac (tokens clipped), ratio_mean
    (the sequence ratio over tokens), approx_kl (k1 of the tokens).
    """
    advantages = per_token(advantages, logprobs)
    valid = mask.bool()
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-cfg.clip_low, cfg.clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    ratio = torch.exp(masked_mean(pessimistic, valid, dim=-1))
    advantage = masked_mean(advantages, valid, dim=-1)
    loss = torch.where(valid, (-advantage * ratio).unsqueeze(-1).expand_as(logprobs), 0.0)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((log_ratio != clamped).to(logprobs.dtype), valid),
            "ratio_mean": masked_mean(ratio.unsqueeze(-1).expand_as(logprobs), valid),
            "approx_kl": masked_mean(-log_ratio, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


GMPO = PolicyLoss(config=GMPOConfig, compute=gmpo_loss, stats=("clip_frac", "ratio_mean", "approx_kl"))
