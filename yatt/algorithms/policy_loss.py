"""Policy-gradient losses. Each returns a per-token loss [B, T] (0 where masked) and a stats dict."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from yatt.algorithms.aggregation import masked_mean

# Same reasoning as in kl.py: keeps exp() finite for tokens whose probability moved enormously.
LOG_RATIO_CLAMP = 20.0


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token, with optional clip-higher (DAPO) and dual-clip.

    ratio = exp(logprobs - old_logprobs); the loss is max(-A*ratio, -A*clip(ratio, 1-clip_low,
    1+clip_high)), the pessimistic bound. clip_high > clip_low ("clip-higher") lets low-probability
    tokens with A > 0 grow further, which counters entropy collapse. With dual_clip = c > 1
    (Ye et al. 2020) tokens with A < 0 are additionally capped at -A*c: for A < 0 the plain PPO
    bound is unbounded as ratio grows, so one stale token could otherwise dominate the update.

    `advantages` is [B] (one per sequence, broadcast over tokens) or [B, T]. Stats are detached
    0-dim masked means over valid tokens: clip_frac, dual_clip_frac, ratio_mean, approx_kl.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)

    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
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
            "approx_kl": masked_mean(0.5 * log_ratio**2, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo_clip": ppo_clip_loss
}


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """Look up a policy loss by name."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}") from None
