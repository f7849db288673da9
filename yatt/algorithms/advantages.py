"""Advantage estimators: GRPO (group-relative, critic-free) and GAE (for a future critic/PPO)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages: each sample's reward minus its group's mean (optionally / std).

    `rewards` is [N] with consecutive runs of `group_size` samples answering the same prompt.
    The std is the unbiased one (torch default, as in the GRPO paper and veRL); a group whose
    rewards are all equal gets advantage 0 (its std is 0, the numerator is 0), and a group of
    size 1 gets 0 because it carries no relative signal (its unbiased std would be NaN).
    `normalize_std=False` is the Dr. GRPO variant, which avoids up-weighting low-variance groups.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    if group_size == 1:
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


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


# GAE is not listed: it needs per-token values from a critic, not just sequence rewards.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {"grpo": grpo_advantages}


def get_advantage_estimator(name: str) -> Callable[..., Tensor]:
    """Look up an advantage estimator by name."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
