"""ReMax advantages (Li et al. 2024, "ReMax"): each sample's reward minus the reward of its prompt's greedy
response, a baseline the controller generates with the group (`needs_greedy_baseline`)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class ReMaxConfig(ComponentConfig):
    kind: Literal["remax"] = "remax"


def remax_advantages(rewards: Tensor, baselines: Tensor) -> Tensor:
    """rewards [N] - baselines [N] (the greedy response's reward of each sample's prompt)."""
    if baselines.shape != rewards.shape:
        raise ValueError(f"remax: {tuple(baselines.shape)} baselines for {tuple(rewards.shape)} rewards")
    return rewards - baselines


def _compute(inp: AdvantageInput, cfg: ReMaxConfig) -> Tensor:
    if inp.baselines is None:
        raise ValueError(
            "remax needs the greedy baselines (AdvantageInput.baselines); the controller passes them "
            "when the estimator says needs_greedy_baseline"
        )
    return remax_advantages(inp.rewards, inp.baselines)


# the baseline travels with each sample, so groups may be split across ranks
REMAX = AdvantageEstimator(config=ReMaxConfig, compute=_compute, needs_groups=False, needs_greedy_baseline=True)
