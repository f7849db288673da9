"""GSPO's sequence-level policy loss (Zheng et al. 2025, "Group Sequence Policy Optimization")."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from yatt.algorithms.aggregation import masked_mean, per_token
from yatt.algorithms.base import ComponentConfig, PolicyLoss

# exp() of the sequence log-ratio stays finite; a sequence this far off is clipped anyway (veRL uses 10 too).
LOG_RATIO_MAX = 10.0


class GSPOConfig(ComponentConfig):
    kind: Literal["gspo"] = "gspo"
    clip_low: float = Field(
        3e-4,
        gt=0.0,
        lt=1.0,
        description="Sequence-ratio floor 1 - clip_low (the paper's "
        "3e-4: a sequence ratio is a geometric mean, so it moves far less than a token's).",
    )
    clip_high: float = Field(4e-4, gt=0.0, description="Sequence-ratio ceiling 1 + clip_high (the paper's 4e-4).")


def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: GSPOConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GSPO loss (the paper's GSPO-token form, as veRL writes it).

    s_i = exp(mean_t (logprob - old_logprob)) over sequence i's response tokens: the length-normalised
    sequence likelihood ratio. Token t carries the ratio sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i
    and whose gradient is s_i * grad log pi(y_t); the loss max(-A*s, -A*clip(s, 1-clip_low, 1+clip_high))
    then clips whole sequences, never single tokens. With a per-sequence advantage and
    loss_agg=seq-mean-token-mean this is exactly the GSPO objective. A sequence without response tokens
    gets s = 1 and loss 0. Stats: clip_frac (tokens of clipped sequences), ratio_mean (s over tokens),
    approx_kl (k1 of the sequence ratio the loss uses: -log s, clamped like s, over tokens) and approx_kl_k2
    (0.5 * (log s)^2).
    """
    advantages = per_token(advantages, logprobs)
    valid = mask.bool()
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)
    seq_log_ratio = masked_mean(log_ratio, valid, dim=-1)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    used_log_ratio = token_log_ratio.clamp(max=LOG_RATIO_MAX)  # value: log s_i on each of sequence i's tokens
    ratio = torch.exp(used_log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.where(valid, torch.maximum(loss1, loss2), 0.0)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((loss2 > loss1).to(logprobs.dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "approx_kl": masked_mean(-used_log_ratio, valid),
            "approx_kl_k2": masked_mean(0.5 * used_log_ratio**2, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


GSPO = PolicyLoss(config=GSPOConfig, compute=gspo_loss, stats=("clip_frac", "ratio_mean", "approx_kl", "approx_kl_k2"))
