"""KL-Cov (Cui et al. 2025, arXiv:2505.22617): the unclipped policy-gradient loss, with a KL penalty on the
tokens of highest covariance, against entropy collapse."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.aggregation import clamped_log_ratio, masked_mean, per_token
from yatt.algorithms.base import ComponentConfig, PolicyLoss
from yatt.algorithms.clip_cov import token_covariance


class KLCovConfig(ComponentConfig):
    kind: Literal["kl_cov"] = "kl_cov"
    cov_ratio: float = Field(2e-4, gt=0.0, le=1.0, description="Fraction of the response tokens penalised.")
    kl_coef: float = Field(1.0, ge=0.0, description="Weight of |logprob - old_logprob| on the penalised tokens.")


def kl_cov_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: KLCovConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token -A * r, r = exp(logprob - old_logprob) (no clip), plus kl_coef * |logprob - old_logprob| on the
    max(1, cov_ratio * tokens) valid tokens of largest covariance (`token_covariance`; veRL's kl_cov).
    Stats: kl_frac (tokens penalised), ratio_mean, approx_kl_abs (mean |log-ratio|)."""
    advantages = per_token(advantages, logprobs)
    valid = mask.bool()
    log_ratio = clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    cov = token_covariance(logprobs, advantages, mask).masked_fill(~valid, -torch.inf)
    count = min(max(int(cfg.cov_ratio * float(valid.sum())), 1), int(valid.sum()))
    penalised = torch.zeros_like(valid)
    if count:
        top = cov.reshape(-1).topk(count).indices
        penalised.view(-1)[top] = True
    loss = -advantages * ratio + cfg.kl_coef * log_ratio.abs() * penalised
    loss = torch.where(valid, loss, 0.0)
    with torch.no_grad():
        stats = {
            "kl_frac": masked_mean(penalised.to(logprobs.dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "approx_kl_abs": masked_mean(log_ratio.abs(), valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


KL_COV = PolicyLoss(config=KLCovConfig, compute=kl_cov_loss, stats=("kl_frac", "ratio_mean", "approx_kl_abs"))
