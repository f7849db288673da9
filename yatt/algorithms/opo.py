"""OPO advantages (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585): each
sample's reward minus its group's length-weighted mean reward.

The variance-minimising baseline of a policy gradient is E[|g|^2 r] / E[|g|^2], with g a sample's gradient
of log pi. OPO takes the response length as the proxy for |g|^2 (a sequence's log-prob sums one term per
token), so b = sum_i len_i r_i / sum_i len_i over the group: long responses count more in the baseline. OPO
trains strictly on-policy (one epoch, one mini-batch); that is the user's setting, not checked here.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class OPOConfig(ComponentConfig):
    kind: Literal["opo"] = "opo"


def opo_advantages(rewards: Tensor, lengths: Tensor, group_size: int) -> Tensor:
    """r_i - sum_j len_j r_j / sum_j len_j over consecutive groups of `group_size` in `rewards` [N].

    `lengths` [N] are the response token counts. A group whose responses are all empty falls back to the plain
    mean; a group of size 1 (its own reward as baseline) and a group of equal rewards get 0.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0 or lengths.shape != rewards.shape:
        raise ValueError(
            f"rewards and lengths must be 1-D of the same length, divisible by group_size={group_size}, "
            f"got {tuple(rewards.shape)} and {tuple(lengths.shape)}"
        )
    grouped = rewards.view(-1, group_size)
    weights = lengths.to(rewards.dtype).view(-1, group_size)
    weights = torch.where(weights.sum(dim=1, keepdim=True) > 0, weights, 1.0)
    baseline = (weights * grouped).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True)
    return (grouped - baseline).reshape(-1)


def _compute(inp: AdvantageInput, cfg: OPOConfig) -> Tensor:
    return opo_advantages(inp.rewards, inp.mask.sum(dim=-1), inp.group_size)


OPO = AdvantageEstimator(config=OPOConfig, compute=_compute, needs_groups=True)
