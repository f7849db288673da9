"""PPO's clipped value loss: the critic regresses the GAE returns without moving far from its old values."""

from __future__ import annotations

import torch
from torch import Tensor

from yatt.algorithms.aggregation import masked_mean


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old + clip(V - old, -clip, +clip), as PPO2,
    veRL and OpenRLHF do: the pessimistic of the plain and the clipped error, so one update cannot move a
    value further than `clip` from the value the advantages were computed with. clip=None: 0.5 * (V - R)^2.

    All [B, T]; the loss is 0 where masked (aggregate it like the policy loss, aggregation.aggregate_loss).
    Stats are detached 0-dim masked means over valid tokens: vf_clipfrac (tokens whose clipped error is the
    larger, i.e. the clip took the gradient away) and value_pred_mean (V of this forward).
    """
    valid = mask.bool()
    # masked first, so a non-finite value there cannot reach the gradient (0 * inf = NaN in backward)
    values, old_values, returns = (torch.where(valid, x, 0.0) for x in (values, old_values, returns))
    plain = (values - returns) ** 2
    if clip is None:
        loss, clipped_active = 0.5 * plain, torch.zeros_like(valid)
    else:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
        loss, clipped_active = 0.5 * torch.maximum(plain, clipped), clipped > plain
    loss = torch.where(valid, loss, 0.0)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean(clipped_active.to(values.dtype), valid),
            "value_pred_mean": masked_mean(values, valid),
        }
    return loss, {k: v.detach() for k, v in stats.items()}
