"""Rollout importance-sampling correction: reweight the policy loss by pi_trainer / pi_rollout.

The engine samples from its own copy of the policy (another kernel, maybe bfloat16, maybe weights a few
steps stale), so the tokens are off-policy for the trainer. The ratio pi_trainer(y) / pi_rollout(y) of the
trainer's log-probs before the update (`old_logprobs`) to the engine's (`rollout_logprobs`) corrects that:
- truncated IS (TIS, Yao et al. 2025 "Your efficient RL framework secretly brings you off-policy RL
  training"): weight min(ratio, C), which bounds the variance a few huge ratios would add;
- masked IS (veRL's rollout rejection sampling, "MIS"): weight 1, or 0 for tokens (or whole sequences)
  whose ratio is outside [lower, C] -- those are dropped from the gradient.
At level `token` each token has its own ratio; at `sequence` a sequence's ratio is the product over its
tokens, exp(sum of log-ratios), the unbiased sequence-level weight; at `geometric` it is the geometric mean
exp(mean of log-ratios), a length-independent sequence ratio. The weights are constants (no gradient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from yatt.algorithms.aggregation import masked_mean, masked_sum

if TYPE_CHECKING:
    from yatt.distributed import World

# keeps exp() finite; a ratio of e^20 is far beyond any threshold anyway
LOG_RATIO_CLAMP = 20.0


class RolloutISConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["none", "truncate", "mask"] = Field(
        "none",
        description="none: no correction (the ratio is still measured and logged as rollout_is/*). "
        "truncate: weight each token's policy loss by min(ratio, threshold). mask: drop tokens (or sequences) "
        "whose ratio is above threshold or below lower_threshold.",
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="token: one ratio per token. sequence: the product of a sequence's token ratios. "
        "geometric: their geometric mean (length-independent).",
    )
    threshold: float = Field(2.0, gt=1.0, description="C: truncation cap (truncate) or upper bound (mask).")
    lower_threshold: float | None = Field(
        None, gt=0.0, lt=1.0, description="mask: lower bound of the kept ratios; None: 1 / threshold."
    )

    @model_validator(mode="after")
    def _lower_only_for_mask(self) -> RolloutISConfig:
        if self.lower_threshold is not None and self.mode != "mask":
            raise ValueError("algorithm.rollout_is.lower_threshold applies to mode=mask only")
        return self


def is_ratios(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """[B, T] ratio pi_trainer / pi_rollout per token at the given level (a sequence's ratio on each of its
    tokens), 1 where masked."""
    valid = mask.bool()
    log_ratio = torch.where(valid, old_logprobs - rollout_logprobs, 0.0)
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, valid, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    elif level == "geometric":
        log_ratio = masked_mean(log_ratio, valid, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return torch.where(valid, ratio, 1.0)


def is_weights(ratio: Tensor, mask: Tensor, cfg: RolloutISConfig) -> tuple[Tensor, Tensor]:
    """(weights [B, T], changed [B, T] bool: tokens truncated or dropped); weights are 0 where masked."""
    valid = mask.bool()
    if cfg.mode == "truncate":
        changed = valid & (ratio > cfg.threshold)
        weights = ratio.clamp(max=cfg.threshold)
    elif cfg.mode == "mask":
        lower = cfg.lower_threshold if cfg.lower_threshold is not None else 1.0 / cfg.threshold
        changed = valid & ((ratio > cfg.threshold) | (ratio < lower))
        weights = (~changed).to(ratio.dtype)
    else:
        changed, weights = torch.zeros_like(valid), torch.ones_like(ratio)
    return torch.where(valid, weights, 0.0), changed


def correction_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: RolloutISConfig
) -> Tensor | None:
    """[B, T] weights of the policy loss (0 where masked), or None when mode is none. Every level's ratio
    depends on its own row only, so a micro-batch of whole rows gets exactly its rows' weights."""
    if cfg.mode == "none":
        return None
    return is_weights(is_ratios(old_logprobs, rollout_logprobs, mask, cfg.level), mask, cfg)[0]


def mismatch_metrics(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: RolloutISConfig, world: World | None = None
) -> dict[str, float]:
    """Metrics over all ranks (token-weighted; every rank must call this): rollout_is/ratio_mean, ratio_max,
    ratio_min (the ratio at the configured level), rollout_is/mismatch_kl (mean k3 estimate of
    KL(rollout || trainer) per token), rollout_is/changed_frac (tokens truncated or dropped) and
    rollout_is/weight_mean. Measured with mode none too."""
    valid = mask.bool()
    ratio = is_ratios(old_logprobs, rollout_logprobs, mask, cfg.level)
    weights, changed = is_weights(ratio, mask, cfg)
    token_ratio = is_ratios(old_logprobs, rollout_logprobs, mask, "token")
    k3 = token_ratio - 1 - torch.log(token_ratio)  # r - 1 - log r: >= 0, 0 when the two agree
    sums = [
        float(mask.sum()),
        float(masked_sum(ratio, valid)),
        float(masked_sum(k3, valid)),
        float(changed.sum()),
        float(masked_sum(weights, valid)),
    ]
    extremes = [
        float(ratio[valid].max()) if valid.any() else 0.0,
        -float(ratio[valid].min()) if valid.any() else -float("inf"),
    ]
    if world is not None:
        sums, extremes = world.sum(sums), world.max(extremes)
    tokens = max(sums[0], 1.0)
    return {
        "rollout_is/ratio_mean": sums[1] / tokens,
        "rollout_is/mismatch_kl": sums[2] / tokens,
        "rollout_is/changed_frac": sums[3] / tokens,
        "rollout_is/weight_mean": sums[4] / tokens,
        "rollout_is/ratio_max": extremes[0],
        "rollout_is/ratio_min": -extremes[1] if sums[0] else 0.0,
    }
