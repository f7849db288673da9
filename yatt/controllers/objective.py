"""The policy objective handed to the trainer: PPO-clip (+ optional KL loss), aggregated globally."""

from __future__ import annotations

from torch import Tensor

from yatt.algorithms import aggregate_loss, get_policy_loss, kl_estimate, masked_sum, token_logprobs
from yatt.config import AlgorithmConfig
from yatt.trainers.batch import TokenBatch


def policy_objective(algo: AlgorithmConfig, num_tokens: float, num_seqs: float, norm_length: int):
    """A loss function for TorchTrainer.train_mini_batch.

    num_tokens / num_seqs are the mini-batch's global counts divided by the world size: summing
    micro-batch losses and letting DDP average over ranks then gives exactly the loss of the whole
    global mini-batch, whatever the micro-batch and rank split. Stats come back as sums.
    """
    loss_impl = get_policy_loss(algo.policy_loss)

    def loss_fn(logits: Tensor, mb: TokenBatch) -> tuple[Tensor, dict[str, float]]:
        logp = token_logprobs(logits, mb.input_ids[:, 1:])
        token_loss, stats = loss_impl(logp, mb.extras["old_logprobs"], mb.extras["advantages"], mb.mask,
                                      clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip)
        tokens = mb.mask.sum()
        sums = {"tokens": float(tokens), "policy_loss_sum": float(masked_sum(token_loss.detach(), mb.mask))}
        sums.update({f"{k}_sum": float(v) * float(tokens) for k, v in stats.items()})
        if algo.kl_coef > 0 and algo.kl_mode == "loss":
            kl = kl_estimate(logp, mb.extras["ref_logprobs"], algo.kl_estimator)
            token_loss = token_loss + algo.kl_coef * kl
            sums["kl_loss_sum"] = float(masked_sum(kl.detach(), mb.mask))
        loss = aggregate_loss(token_loss, mb.mask, algo.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                              norm_length=norm_length)
        return loss, sums

    return loss_fn
