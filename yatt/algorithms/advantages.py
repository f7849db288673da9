"""Advantage helpers shared by estimators: outcome rewards laid out per token, per-sequence values
broadcast to tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def outcome_token_rewards(outcome: Tensor, mask: Tensor, token_kl: Tensor | None) -> Tensor:
    """[N, T] per-token rewards: -token_kl on every valid token (0 without a KL penalty), plus the outcome
    reward [N] on each sequence's last valid token; 0 where masked. A sequence without response tokens
    gets nothing (its outcome has no token to sit on)."""
    valid = mask.bool()
    if token_kl is not None:
        rewards = -torch.where(valid, token_kl, 0.0).to(outcome.dtype)
    else:
        rewards = torch.zeros(mask.shape, dtype=outcome.dtype)
    positions = torch.arange(mask.shape[-1]).expand_as(valid)
    last = (
        torch.where(valid, positions, -1).max(dim=-1).values
        if mask.shape[-1]
        else positions.new_full((mask.shape[0],), -1)
    )
    has = last >= 0
    rewards[has, last[has]] += outcome[has]
    return rewards


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """[B] per-sequence values -> [B, T] per-token values, zero where mask is 0."""
    return torch.where(mask.bool(), seq_values.unsqueeze(-1), 0.0).to(seq_values.dtype)
