"""Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv:2505.22617): PPO's loss, with the gradient of a few high-covariance tokens cut, against entropy collapse."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from yatt.algorithms.aggregation import clamped_log_ratio, masked_mean, per_token
from yatt.algorithms.base import ComponentConfig, PolicyLoss


class ClipCovConfig(ComponentConfig):
    kind: Literal["clip_cov"] = "clip_cov"
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO's ratio floor 1 - clip_low.")
    clip_high: float = Field(0.2, gt=0.0, description="PPO's ratio ceiling 1 + clip_high.")
    cov_ratio: float = Field(2e-4, gt=0.0, le=1.0, description="Fraction of the response tokens whose gradient is cut.")
    cov_lower: float = Field(1.0, description="Tokens are picked among those whose covariance is above this...")
    cov_upper: float = Field(5.0, description="...and below this.")

    @model_validator(mode="after")
    def _ordered(self) -> ClipCovConfig:
        if self.cov_lower >= self.cov_upper:
            raise ValueError("algorithm.policy_loss.cov_lower must be below cov_upper")
        return self


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """(A - mean A) * (logprob - mean logprob) per token, the means over the valid tokens (no gradient): a
    token's contribution to the covariance whose sign drives the entropy change (the paper's Eq. 5)."""
    valid = mask.bool()
    logprobs = logprobs.detach()
    return (advantages - masked_mean(advantages, valid)) * (logprobs - masked_mean(logprobs, valid))


def picked_tokens(candidates: Tensor, count: int, old_logprobs: Tensor) -> Tensor:
    """`count` of the candidate positions, drawn at random as the paper does, from a generator seeded by the
    batch itself (its old log-probs), so that a rerun or a resumed run picks the same ones."""
    where = candidates.nonzero()
    seed = int(old_logprobs.detach().double().abs().sum().item() * 1e6) % (2**63)
    order = torch.randperm(len(where), generator=torch.Generator().manual_seed(seed))
    return where[order[: min(count, len(where))]]


def clip_cov_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: ClipCovConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped loss, times 0 on max(1, cov_ratio * tokens) tokens picked at random among those PPO did not
    clip whose covariance (`token_covariance`) lies in (cov_lower, cov_upper): their gradient is cut
    (veRL's clip_cov). Stats: clip_frac (PPO's), cov_cut_frac, ratio_mean, approx_kl (k1)."""
    advantages = per_token(advantages, logprobs)
    valid = mask.bool()
    log_ratio = clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped = (loss2 > loss1) & valid
    cov = token_covariance(logprobs, advantages, mask)
    candidates = valid & ~clipped & (cov > cfg.cov_lower) & (cov < cfg.cov_upper)
    count = max(int(cfg.cov_ratio * float(valid.sum())), 1)
    keep = torch.ones_like(logprobs)
    picked = picked_tokens(candidates, count, old_logprobs)
    keep[picked[:, 0], picked[:, 1]] = 0.0
    loss = torch.where(valid, torch.maximum(loss1, loss2) * keep, 0.0)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(clipped.to(logprobs.dtype), valid),
            "cov_cut_frac": masked_mean((keep == 0).to(logprobs.dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "approx_kl": masked_mean(-log_ratio, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


CLIP_COV = PolicyLoss(
    config=ClipCovConfig, compute=clip_cov_loss, stats=("clip_frac", "cov_cut_frac", "ratio_mean", "approx_kl")
)
