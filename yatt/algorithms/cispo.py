"""CISPO's policy loss (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585): clip the importance weight, keep every
token's gradient."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.aggregation import clamped_log_ratio, masked_mean, per_token
from yatt.algorithms.base import ComponentConfig, PolicyLoss


class CISPOConfig(ComponentConfig):
    kind: Literal["cispo"] = "cispo"
    clip_low: float = Field(0.2, gt=0.0, le=1.0, description="Weight floor 1 - clip_low (1: no floor).")
    clip_high: float = Field(0.2, gt=0.0, description="Weight ceiling 1 + clip_high.")


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: CISPOConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprob, r = exp(logprob - old_logprob).

    PPO zeroes the gradient of a token whose ratio left the band (its clipped term is a constant); CISPO
    clips the weight instead, under a stop-gradient, so every token keeps the gradient of A * logprob, scaled
    by a bounded weight. Stats: clip_frac (tokens whose weight was clipped), ratio_mean, approx_kl (k1).
    """
    advantages = per_token(advantages, logprobs)
    log_ratio = clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high).detach()
    valid = mask.bool()
    loss = torch.where(valid, -weight * advantages * logprobs, 0.0)
    with torch.no_grad():
        clipped = (ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)
        stats = {
            "clip_frac": masked_mean(clipped.to(logprobs.dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "approx_kl": masked_mean(-log_ratio, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


CISPO = PolicyLoss(config=CISPOConfig, compute=cispo_loss, stats=("clip_frac", "ratio_mean", "approx_kl"))
