"""PPO's clipped surrogate policy loss, with clip-higher (DAPO) and dual-clip."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.aggregation import clamped_log_ratio, masked_mean, per_token
from yatt.algorithms.base import ComponentConfig, PolicyLoss


class PPOClipConfig(ComponentConfig):
    kind: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="Ratio floor 1 - clip_low.")
    clip_high: float = Field(
        0.2, gt=0.0, description="Ratio ceiling 1 + clip_high; above clip_low for clip-higher (DAPO)."
    )
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip bound c for negative advantages.")


def ppo_clip_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: PPOClipConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token, with optional clip-higher (DAPO) and dual-clip.

    ratio = exp(logprobs - old_logprobs); the loss is max(-A*ratio, -A*clip(ratio, 1-clip_low,
    1+clip_high)), the pessimistic bound. clip_high > clip_low ("clip-higher") lets low-probability
    tokens with A > 0 grow further, which counters entropy collapse. With dual_clip = c > 1
    (Ye et al. 2020) tokens with A < 0 are additionally capped at -A*c: for A < 0 the plain PPO
    bound is unbounded as ratio grows, so one stale token could otherwise dominate the update.

    `advantages` is [B] (one per sequence, broadcast over tokens) or [B, T]. Stats are detached
    0-dim masked means over valid tokens: clip_frac, dual_clip_frac, ratio_mean, approx_kl (k1 of the ratio the
    loss uses: old_logprob - logprob, the log-ratio clamped like the ratio) and approx_kl_k2 (0.5 * that^2,
    which is never negative).
    """
    clip_low, clip_high, dual_clip = cfg.clip_low, cfg.clip_high, cfg.dual_clip
    advantages = per_token(advantages, logprobs)

    log_ratio = clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clip_active = loss2 > loss1

    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
    else:
        dual_active = torch.zeros_like(clip_active)

    valid = mask.bool()
    loss = torch.where(valid, loss, 0.0)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(clip_active.to(logprobs.dtype), valid),
            "dual_clip_frac": masked_mean(dual_active.to(logprobs.dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "approx_kl": masked_mean(-log_ratio, valid),
            "approx_kl_k2": masked_mean(0.5 * log_ratio**2, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


PPO_CLIP = PolicyLoss(
    config=PPOClipConfig,
    compute=ppo_clip_loss,
    stats=("clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl", "approx_kl_k2"),
)
