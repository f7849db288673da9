"""PPO's critic in the step: per-token values before the advantages, a value-loss update next to the policy's,
its metrics and its state.

The value model is a `Trainer` built with head="value" by the factory (yatt.controllers.components) on the
same backend as the policy; it lives on the train device, so it offloads and onloads with the `train` role.
It trains on the policy's mini-batches (same rows, epochs and global denominators), with its own optimizer.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from yatt.algorithms.aggregation import aggregate_loss, masked_sum
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.gae import critic_targets
from yatt.algorithms.value_loss import clipped_value_loss
from yatt.controllers.minibatches import global_mini_batches
from yatt.distributed import World
from yatt.placement.metrics import summed
from yatt.tensors import LossFn, TokenBatch
from yatt.trainers.base import Trainer
from yatt.trainers.critic_config import CriticConfig

STATS = ("value_loss", "vf_clipfrac", "value_pred_mean")  # sums over the trained tokens, logged as means


class Critic:
    def __init__(self, cfg: CriticConfig, trainer: Trainer, world: World, loss_agg: str, norm_length: int):
        """loss_agg: critic.loss_agg, or the policy's when that is null; norm_length as the policy's."""
        self.cfg, self.trainer, self.world = cfg, trainer, world
        self.loss_agg, self.norm_length = loss_agg, norm_length

    def warming_up(self, step: int) -> bool:
        """Whether `step` (1-based) trains only the critic (critic.warmup_steps)."""
        return step <= self.cfg.warmup_steps

    def values(self, batch: TokenBatch) -> Tensor:
        """V at every response token before this step's update [B, L-1], 0 outside the mask."""
        return self.trainer.values(batch)

    def targets(self, inp: AdvantageInput, returns: Tensor | None) -> Tensor:
        """What the values regress to: the estimator's returns (gae), or with an estimator that computes none
        (critic.enabled: true by hand) the undiscounted returns of the same token rewards."""
        return returns if returns is not None else critic_targets(inp)

    def objective(self, num_tokens: float, num_seqs: float) -> LossFn:
        """The clipped value loss against mb.extras["returns"], around mb.extras["values"] (the values the
        advantages were computed with), aggregated like the policy loss with global denominators."""

        def loss_fn(values: Tensor, _entropy: Tensor | None, mb: TokenBatch) -> tuple[Tensor, dict[str, float]]:
            token_loss, stats = clipped_value_loss(
                values, mb.extras["values"], mb.extras["returns"], mb.mask, self.cfg.value_clip
            )
            tokens = float(mb.mask.sum())
            sums = {
                "tokens": tokens,
                "value_loss": float(masked_sum(token_loss.detach(), mb.mask)),
                **{k: float(v) * tokens for k, v in stats.items()},
            }
            loss = aggregate_loss(
                token_loss,
                mb.mask,
                self.loss_agg,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                norm_length=self.norm_length,
            )
            return loss, sums

        return loss_fn

    def update(self, batch: TokenBatch, epochs: list[list[Tensor]]) -> dict[str, float]:
        """One optimizer step per mini-batch of every epoch (the policy's rows); sums of the loss stats, plus
        grad_norm, lr and skipped summed over the optimizer steps. batch.extras holds values and returns."""
        totals = dict.fromkeys(("tokens", *STATS, "grad_norm", "lr", "skipped", "optimizer_steps"), 0.0)
        for _, mini, tokens, seqs in global_mini_batches(self.world, batch, epochs):
            stats = self.trainer.train_mini_batch(mini, self.objective(tokens, seqs))
            stats["optimizer_steps"] = 1.0
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        return totals

    def metrics(self, batch: TokenBatch, update: dict[str, float], warming_up: bool = False) -> dict[str, float]:
        """critic/* over all ranks: the update's means, and how well the old values explained the returns
        (explained_var = 1 - Var(returns - values) / Var(returns), over every response token); warmup is 1 in
        a step that trained only the critic."""
        mask, values, returns = batch.mask, batch.extras["values"], batch.extras["returns"]
        error = returns - values
        s = summed(
            self.world,
            {
                "trained_tokens": update["tokens"],
                **{k: update[k] for k in STATS},
                "tokens": float(mask.sum()),
                "values": float(masked_sum(values, mask)),
                "returns": float(masked_sum(returns, mask)),
                "returns_sq": float(masked_sum(returns**2, mask)),
                "error": float(masked_sum(error, mask)),
                "error_sq": float(masked_sum(error**2, mask)),
            },
        )
        n = max(s["tokens"], 1.0)
        var_returns = s["returns_sq"] / n - (s["returns"] / n) ** 2
        var_error = s["error_sq"] / n - (s["error"] / n) ** 2
        steps = max(update["optimizer_steps"], 1.0)
        return {
            **{f"critic/{k}": s[k] / max(s["trained_tokens"], 1.0) for k in STATS},
            "critic/value_mean": s["values"] / n,
            "critic/returns_mean": s["returns"] / n,
            "critic/explained_var": 1.0 - var_error / var_returns if var_returns > 1e-12 else 0.0,
            "critic/grad_norm": update["grad_norm"] / steps,
            "critic/lr": update["lr"] / steps,
            "critic/skipped_steps": update["skipped"],
            "critic/warmup": float(warming_up),
        }

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)
