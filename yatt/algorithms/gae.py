"""GAE advantages (Schulman et al. 2016) from a critic's per-token values: PPO with a critic.

Token rewards are the outcome reward on the last response token, minus the per-token KL penalty with
`algorithm.kl_mode: reward` (as REINFORCE++ shapes them); values are the critic's V(prefix) at each
response token, 0 after the last one (terminal). The critic's regression targets are the returns
A + V, taken before the advantages are whitened over the global batch (as veRL and OpenRLHF do).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.advantages import outcome_token_rewards
from yatt.algorithms.aggregation import global_whiten, masked_sum
from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig


class GAEConfig(ComponentConfig):
    kind: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of later token rewards.")
    lam: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="GAE lambda: 1 is the Monte-Carlo return minus V "
        "(unbiased, leans on the critic least); lower trades variance for the critic's bias.",
    )
    whiten: bool = Field(
        True,
        description="Whiten the advantages over every response token of every rank "
        "(a global mean and variance); the critic's targets are unaffected.",
    )


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
    if length == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
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


def token_rewards(inp: AdvantageInput) -> Tensor:
    """[N, T] rewards of the rank's samples: the outcome on each last response token, minus the KL penalty per
    token (kl_mode=reward; `inp.rewards` already subtract its sum, which is added back to spread it out)."""
    outcome = inp.rewards
    if inp.token_kl is not None:
        outcome = outcome + masked_sum(inp.token_kl, inp.mask, dim=-1)
    return outcome_token_rewards(outcome, inp.mask, inp.token_kl)


def gae_estimate(inp: AdvantageInput, cfg: GAEConfig) -> tuple[Tensor, Tensor]:
    """(advantages [N, T], the critic's targets [N, T]) from the rank's samples and their values."""
    if inp.values is None:
        raise ValueError("algorithm.advantage.kind=gae needs the critic's values (critic.enabled)")
    rewards = token_rewards(inp)
    advantages, returns = gae_advantages(rewards, inp.values.to(rewards.dtype), inp.mask, cfg.gamma, cfg.lam)
    if cfg.whiten:
        advantages = global_whiten(advantages, inp.mask, inp.world)
    return advantages, returns


def critic_targets(inp: AdvantageInput) -> Tensor:
    """The critic's targets with an estimator that computes none (critic.enabled: true with e.g. grpo): the
    undiscounted returns of `token_rewards`, what GAE with gamma = lambda = 1 regresses to."""
    rewards = token_rewards(inp)
    return gae_advantages(rewards, torch.zeros_like(rewards), inp.mask, 1.0, 1.0)[1]


GAE = AdvantageEstimator(config=GAEConfig, compute=gae_estimate, needs_groups=False, needs_values=True)
