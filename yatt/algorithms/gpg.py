"""GPG advantages (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
Reasoning", arXiv 2504.02546): the group-centred reward without the std division, scaled up by the share of
samples that carry a signal.

A_i = alpha * (r_i - mean of r over i's group) / F_norm, with alpha = B / (B - M): B samples in the batch, M of
them in groups whose rewards are all equal (their centred reward is 0, so they add nothing to the gradient but
still count in a mean over the batch). alpha gives the valid samples the weight they would have in a batch of
valid samples only -- the paper's "accurate gradient estimation" (its Table: F_norm = 1, alpha = B/(B-M) is the
best setting; `normalize_std: true` is its F_norm = group std). B and M are counted over every data-parallel
rank (two numbers summed through World), so alpha does not depend on the rank count; alpha = 1 when no sample
is valid (every advantage is 0 anyway). The paper trains with the plain policy-gradient loss -A * log pi; with
one epoch on on-policy old log-probs, ppo_clip's gradient is exactly that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field
from torch import Tensor

from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig

if TYPE_CHECKING:
    from yatt.distributed import World


class GPGConfig(ComponentConfig):
    kind: Literal["gpg"] = "gpg"
    normalize_std: bool = Field(
        False,
        description="Divide by the group's std (the paper's F_norm = std); false: F_norm = 1, the paper's default.",
    )


def gpg_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = False, world: World | None = None, eps: float = 1e-6
) -> Tensor:
    """alpha * (r - group mean) [/ (group std + eps)] over consecutive groups of `group_size` in `rewards` [N];
    alpha = B / (B - M) over all ranks of `world` (every rank must call this, one holding no samples too)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    invalid = float((grouped == grouped[:, :1]).all(dim=1).sum()) * group_size
    counts = [float(rewards.numel()), invalid]
    total, invalid = world.sum(counts) if world is not None else counts
    alpha = total / (total - invalid) if total > invalid else 1.0
    return (alpha * centered).reshape(-1)


def _compute(inp: AdvantageInput, cfg: GPGConfig) -> Tensor:
    return gpg_advantages(inp.rewards, inp.group_size, cfg.normalize_std, inp.world)


GPG = AdvantageEstimator(config=GPGConfig, compute=_compute, needs_groups=True)
