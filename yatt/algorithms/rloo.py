"""RLOO advantages (Ahmadian et al. 2024, "Back to Basics"): each sample's reward minus the mean reward of
the *other* samples of its prompt, a leave-one-out baseline that does not depend on the sample itself."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class RLOOConfig(ComponentConfig):
    kind: Literal["rloo"] = "rloo"


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """r_i - mean_{j != i} r_j over consecutive groups of `group_size` in `rewards` [N].

    Computed as G/(G-1) * (r_i - mean_j r_j), the same value without a G x G matrix. A group of size 1 has
    no other sample to compare with and gets 0; a group of equal rewards gets 0 as well. Unlike GRPO there
    is no division by the std: the estimator stays unbiased.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got shape {tuple(rewards.shape)}"
        )
    if group_size == 1:
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return (centered * (group_size / (group_size - 1))).reshape(-1)


def _compute(inp: AdvantageInput, cfg: RLOOConfig) -> Tensor:
    return rloo_advantages(inp.rewards, inp.group_size)


RLOO = AdvantageEstimator(config=RLOOConfig, compute=_compute, needs_groups=True)
