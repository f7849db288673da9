"""The configured algorithm of a run: advantages from rewards, and the loss the trainer minimises.

`Algorithm` joins the registered advantage estimator and policy loss that `algorithm.advantage.kind` and
`algorithm.policy_loss.kind` name with the loss aggregation, the KL term (its coefficient from the KL
controller), the entropy bonus and the rollout importance-sampling weights. The controller needs nothing
else: a new estimator or loss is added in its own file and registry line, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from yatt.algorithms import ADVANTAGES, POLICY_LOSSES
from yatt.algorithms.aggregation import aggregate_loss, masked_sum
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.kl import kl_estimate
from yatt.algorithms.kl_control import KLController
from yatt.algorithms.rollout_is import correction_weights, mismatch_metrics
from yatt.tensors import LossFn, TokenBatch

if TYPE_CHECKING:
    from yatt.algorithms.config import AlgorithmConfig
    from yatt.distributed import World


def old_logprobs(logp: Tensor, mb: TokenBatch) -> Tensor:
    """The old policy's log-probs. Rows flagged `on_policy` are trained before any optimizer step of this
    RL step, so the trainer's weights are still the old policy: their own detached log-probs are the old
    ones, and no pass computed them beforehand (algorithm.old_logprobs = reuse)."""
    old = mb.extras.get("old_logprobs")
    on_policy = mb.extras.get("on_policy")
    if on_policy is None:
        return old
    fresh = logp.detach()
    return fresh if old is None else torch.where(on_policy.bool()[:, None], fresh, old)


class Algorithm:
    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg
        self.estimator = ADVANTAGES.get(cfg.advantage.kind)
        self.loss = POLICY_LOSSES.get(cfg.policy_loss.kind)
        self.kl_in_loss = cfg.kl_coef > 0 and cfg.kl_mode == "loss"
        self.kl_control = KLController(cfg.kl_coef, cfg.kl_control)

    @property
    def kl_coef(self) -> float:
        """The KL coefficient of this step (algorithm.kl_coef, or where the adaptive controller moved it)."""
        return self.kl_control.coef

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss needs per-token entropies with their gradient (`train_mini_batch(with_entropy=)`)."""
        return self.cfg.entropy_coef > 0

    @property
    def stats(self) -> tuple[str, ...]:
        """What every loss_fn call reports as sums over its tokens (plus "tokens", the count)."""
        return (
            ("policy_loss", *self.loss.stats)
            + (("kl_loss",) if self.kl_in_loss else ())
            + (("entropy_bonus",) if self.needs_entropy else ())
        )

    def advantages(self, inp: AdvantageInput) -> tuple[Tensor, Tensor | None]:
        """(advantages, the critic's targets): the targets only from an estimator that reads values (gae)."""
        out = self.estimator.compute(inp, self.cfg.advantage)
        return out if self.estimator.needs_values else (out, None)

    def mismatch_metrics(self, batch: TokenBatch, world: World | None) -> dict[str, float]:
        """rollout_is/* metrics of the step's batch (its old log-probs complete), over all ranks."""
        return mismatch_metrics(
            batch.extras["old_logprobs"], batch.extras["rollout_logprobs"], batch.mask, self.cfg.rollout_is, world
        )

    def objective(self, num_tokens: float, num_seqs: float, norm_length: int) -> LossFn:
        """A loss function for `Trainer.train_mini_batch` (`yatt.trainers.base.LossFn`).

        num_tokens / num_seqs are the mini-batch's global counts divided by the world size: summing
        micro-batch losses and letting data parallelism average over ranks then gives exactly the loss of
        the whole global mini-batch, whatever the micro-batch and rank split. Stats come back as sums over
        the micro-batch's response tokens, so callers add them up and divide by the global token count.
        Per token: policy loss x IS weight (algorithm.rollout_is, from the micro-batch rows' old and engine
        log-probs) + kl_coef x KL (kl_mode=loss) - entropy_coef x entropy. Masked IS drops tokens through a
        zero weight, so they stay in the denominators.
        """
        cfg, kl_coef = self.cfg, self.kl_coef

        def loss_fn(logp: Tensor, entropy: Tensor | None, mb: TokenBatch) -> tuple[Tensor, dict[str, float]]:
            old = old_logprobs(logp, mb)
            token_loss, stats = self.loss.compute(logp, old, mb.extras["advantages"], mb.mask, cfg.policy_loss)
            if cfg.rollout_is.mode != "none":  # only then do the engine's log-probs have to ride along
                token_loss = token_loss * correction_weights(
                    old, mb.extras["rollout_logprobs"], mb.mask, cfg.rollout_is
                )
            tokens = float(mb.mask.sum())
            sums = {"tokens": tokens, "policy_loss": float(masked_sum(token_loss.detach(), mb.mask))}
            sums.update({k: float(stats[k]) * tokens for k in self.loss.stats})
            if self.kl_in_loss:
                kl = kl_estimate(logp, mb.extras["ref_logprobs"], cfg.kl_estimator)
                token_loss = token_loss + kl_coef * kl
                sums["kl_loss"] = float(masked_sum(kl.detach(), mb.mask))
            if self.needs_entropy:
                if entropy is None:
                    raise ValueError(
                        "algorithm.entropy_coef > 0 but the trainer passed no entropy; call "
                        "train_mini_batch(..., with_entropy=True)"
                    )
                token_loss = token_loss - cfg.entropy_coef * entropy
                sums["entropy_bonus"] = float(masked_sum(entropy.detach(), mb.mask))
            loss = aggregate_loss(
                token_loss, mb.mask, cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length
            )
            return loss, sums

        return loss_fn
