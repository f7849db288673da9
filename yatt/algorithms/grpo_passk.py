"""GRPO pass@k advantages (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and
Exploitation of Large Reasoning Models", arXiv 2508.10751): the analytical advantages of training on the
pass@k reward, for binary rewards.

Pass@k training scores a set of k responses 1 when any of them passes. Over all C(N, k) k-subsets of a group of
N responses of which N_neg fail, the paper derives the group's mean reward and std in closed form,
    R = 1 - C(N_neg, k) / C(N, k),    sigma = sqrt(R (1 - R)),
and each response's advantage (its subsets' mean reward, normalised like GRPO):
    A_pos = (1 - R) / sigma,    A_neg = (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma.
A group that always passes at k (R = 1) or never (R = 0) gets 0: the signal goes to prompts not yet solved
within k tries. k = 1 is GRPO with the population std. The advantages of a group sum to 0.
"""

from __future__ import annotations

from math import comb
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class GRPOPassKConfig(ComponentConfig):
    kind: Literal["grpo_passk"] = "grpo_passk"
    k: int = Field(4, ge=1, description="The k of the pass@k reward trained for; at most rollout.group_size.")
    pass_threshold: float = Field(
        1.0,
        description="A response passes when its reward is at least this (1.0: a "
        "full score); the analytical form is for pass/fail rewards.",
    )


def passk_advantages(rewards: Tensor, group_size: int, k: int, pass_threshold: float = 1.0) -> Tensor:
    """Per-sample pass@k advantages [N] over consecutive groups of `group_size` in `rewards` [N]."""
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got shape {tuple(rewards.shape)}"
        )
    if not 1 <= k <= group_size:
        raise ValueError(f"algorithm.advantage.k={k} must be between 1 and rollout.group_size={group_size}")
    n = group_size
    # by the number of failures f = 0..n of a group: the advantage of a passing and of a failing response
    pos, neg = torch.zeros(n + 1, dtype=torch.float64), torch.zeros(n + 1, dtype=torch.float64)
    for f in range(n + 1):
        mean = 1 - comb(f, k) / comb(n, k)
        sigma = (mean * (1 - mean)) ** 0.5
        if sigma > 0:
            pos[f] = (1 - mean) / sigma
            neg[f] = (1 - mean - (comb(f - 1, k - 1) / comb(n - 1, k - 1) if f else 0.0)) / sigma
    passed = (rewards >= pass_threshold).view(-1, n)
    failures = (~passed).sum(dim=1, keepdim=True).expand(-1, n)
    advantages = torch.where(passed, pos[failures], neg[failures])
    return advantages.reshape(-1).to(rewards.dtype)


def _compute(inp: AdvantageInput, cfg: GRPOPassKConfig) -> Tensor:
    return passk_advantages(inp.rewards, inp.group_size, cfg.k, cfg.pass_threshold)


GRPO_PASSK = AdvantageEstimator(config=GRPOPassKConfig, compute=_compute, needs_groups=True)
