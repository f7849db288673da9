"""RL math as pure tensor functions: advantages, policy losses, KL estimators, loss aggregation.

Per-token tensors are [B, T] with a mask [B, T] (1 = response token); nothing here mutates inputs.
"""

from yatt.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
)
from yatt.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    token_logprobs,
)
from yatt.algorithms.kl import KL_ESTIMATORS, get_kl_estimator, kl_estimate, kl_penalized_rewards
from yatt.algorithms.policy_loss import POLICY_LOSSES, get_policy_loss, ppo_clip_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "aggregate_loss",
    "broadcast_to_tokens",
    "entropy_from_logits",
    "gae_advantages",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "kl_estimate",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_sum",
    "ppo_clip_loss",
    "token_logprobs",
]
