"""A plug-in advantage estimator, as a user writes one outside yatt: one file, chosen from the config by its
import path, `algorithm.advantage: {kind: tests.plugins.my_advantage:ESTIMATOR, scale: 3}`, and handed only its
own typed section (`ScaledCenteredConfig`). Its advantage: scale * (reward - the group's mean reward)."""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class ScaledCenteredConfig(ComponentConfig):
    # `kind` stays ComponentConfig's str: it holds the import path the config names this estimator by
    scale: float = Field(1.0, gt=0.0, description="Multiplies the group-centred reward.")


def scaled_centered(inp: AdvantageInput, cfg: ScaledCenteredConfig) -> Tensor:
    grouped = inp.rewards.view(-1, inp.group_size)
    return (cfg.scale * (grouped - grouped.mean(dim=1, keepdim=True))).reshape(-1)


ESTIMATOR = AdvantageEstimator(config=ScaledCenteredConfig, compute=scaled_centered, needs_groups=True)
