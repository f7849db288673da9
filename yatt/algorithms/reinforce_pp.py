"""REINFORCE++ advantages (Hu et al. 2025, "REINFORCE++"; OpenRLHF's `reinforce` and `reinforce_baseline`):
token returns of the outcome reward shaped by the per-token KL penalty, whitened over the *global* batch.

Whitening uses a mean and a variance over every response token of every data-parallel rank, summed through
`World.sum` (three numbers per step, never a gathered batch), so the advantages are the same whatever the
number of ranks. The `_baseline` variant first subtracts each prompt's mean outcome reward (its groups must
then stay on one rank).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.advantages import outcome_token_rewards
from yatt.algorithms.aggregation import global_whiten, masked_sum
from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class ReinforcePPConfig(ComponentConfig):
    kind: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of later token rewards in the returns.")


class ReinforcePPBaselineConfig(ComponentConfig):
    kind: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of later token rewards in the returns.")


def token_returns(outcome: Tensor, mask: Tensor, token_kl: Tensor | None, gamma: float) -> Tensor:
    """[N, T] returns G_t = sum_{s >= t} gamma^(s-t) r_s over valid tokens, where r_s = -token_kl_s, plus the
    outcome reward [N] on each sequence's last valid token. Masked positions are skipped (0 there)."""
    valid = mask.bool()
    rewards = outcome_token_rewards(outcome, mask, token_kl)
    running = outcome.new_zeros(outcome.shape[0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(mask.shape[-1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def reinforce_pp_advantages(inp: AdvantageInput, gamma: float, group_baseline: bool) -> Tensor:
    outcome = inp.rewards
    if inp.token_kl is not None:  # the KL is applied per token below, not as a sum on the sequence reward
        outcome = outcome + masked_sum(inp.token_kl, inp.mask, dim=-1)
    if group_baseline and outcome.numel():
        grouped = outcome.view(-1, inp.group_size)
        outcome = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    returns = token_returns(outcome, inp.mask, inp.token_kl, gamma)
    return global_whiten(returns, inp.mask, inp.world)


REINFORCE_PP = AdvantageEstimator(
    config=ReinforcePPConfig,
    needs_groups=False,
    compute=lambda inp, cfg: reinforce_pp_advantages(inp, cfg.gamma, group_baseline=False),
)
REINFORCE_PP_BASELINE = AdvantageEstimator(
    config=ReinforcePPBaselineConfig,
    needs_groups=True,
    compute=lambda inp, cfg: reinforce_pp_advantages(inp, cfg.gamma, group_baseline=True),
)
