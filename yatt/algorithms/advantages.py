"""Advantage helpers for estimators with a critic: GAE over per-token values (not registered yet:
it needs a value model), and per-sequence values broadcast to tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over [B, T]; returns (advantages, returns), 0 where masked.

    The recursion runs backwards over *valid* tokens only: a masked position (padding, or e.g.
    tool output inside a multi-turn response) is skipped, so the next valid token's value and
    running GAE carry through it unchanged. The value after the last valid token is 0 (terminal).
    returns = advantages + values, the regression target for a critic.
    """
    valid = mask.bool()
    m = valid.to(values.dtype)
    batch, length = values.shape
    next_value = values.new_zeros(batch)
    last_gae = values.new_zeros(batch)
    advantages = []
    for t in reversed(range(length)):
        v_t = torch.where(valid[:, t], values[:, t], 0.0)
        r_t = torch.where(valid[:, t], token_rewards[:, t], 0.0)
        delta = r_t + gamma * next_value - v_t
        gae_t = delta + gamma * lam * last_gae
        last_gae = m[:, t] * gae_t + (1 - m[:, t]) * last_gae
        next_value = m[:, t] * v_t + (1 - m[:, t]) * next_value
        advantages.append(gae_t * m[:, t])
    adv = torch.stack(advantages[::-1], dim=1)
    returns = (adv + torch.where(valid, values, 0.0)) * m
    return adv, returns


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """[B] per-sequence values -> [B, T] per-token values, zero where mask is 0."""
    return torch.where(mask.bool(), seq_values.unsqueeze(-1), 0.0).to(seq_values.dtype)
