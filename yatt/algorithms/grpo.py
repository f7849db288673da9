"""GRPO advantages: each sample's reward relative to the other samples of its prompt (critic-free)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class GRPOConfig(ComponentConfig):
    kind: Literal["grpo"] = "grpo"
    normalize_std: bool = Field(True, description="Divide group-centred rewards by the group std (false: Dr. GRPO).")


def grpo_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
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
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got shape {tuple(rewards.shape)}"
        )
    if group_size == 1:
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def _compute(inp: AdvantageInput, cfg: GRPOConfig) -> Tensor:
    return grpo_advantages(inp.rewards, inp.group_size, normalize_std=cfg.normalize_std)


GRPO = AdvantageEstimator(config=GRPOConfig, compute=_compute, needs_groups=True)
