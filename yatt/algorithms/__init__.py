"""RL math as pure tensor functions: advantages, policy losses, KL estimators, loss aggregation.

Per-token tensors are [B, T] with a mask [B, T] (1 = response token); nothing here mutates inputs.
`ADVANTAGES` and `POLICY_LOSSES` name the estimators and losses the config may choose
(`algorithm.advantage.kind`, `algorithm.policy_loss.kind`); each entry is one file (see `base.py`). `KL_ESTIMATORS`
(kl.py) and `LOSS_AGGREGATIONS` (aggregation.py) are registries too; every one also takes an import path
'pkg.module:attr' to code outside yatt (docs/extending.md).
"""

from yatt.algorithms.advantages import broadcast_to_tokens
from yatt.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    token_logprobs,
)
from yatt.algorithms.gae import gae_advantages
from yatt.algorithms.kl import KL_ESTIMATORS, get_kl_estimator, kl_estimate, kl_penalized_rewards
from yatt.registry import Registry

ADVANTAGES: Registry = Registry(
    "algorithm.advantage.kind",
    {
        "grpo": "yatt.algorithms.grpo:GRPO",
        "rloo": "yatt.algorithms.rloo:RLOO",
        "remax": "yatt.algorithms.remax:REMAX",
        "reinforce_pp": "yatt.algorithms.reinforce_pp:REINFORCE_PP",
        "reinforce_pp_baseline": "yatt.algorithms.reinforce_pp:REINFORCE_PP_BASELINE",
        "gae": "yatt.algorithms.gae:GAE",
        "opo": "yatt.algorithms.opo:OPO",
        "gpg": "yatt.algorithms.gpg:GPG",
        "grpo_passk": "yatt.algorithms.grpo_passk:GRPO_PASSK",
        "distill": "yatt.algorithms.distill:DISTILL",
    },
)
POLICY_LOSSES: Registry = Registry(
    "algorithm.policy_loss.kind",
    {
        "ppo_clip": "yatt.algorithms.ppo_clip:PPO_CLIP",
        "gspo": "yatt.algorithms.gspo:GSPO",
        "cispo": "yatt.algorithms.cispo:CISPO",
        "sapo": "yatt.algorithms.sapo:SAPO",
        "gmpo": "yatt.algorithms.gmpo:GMPO",
        "clip_cov": "yatt.algorithms.clip_cov:CLIP_COV",
        "kl_cov": "yatt.algorithms.kl_cov:KL_COV",
    },
)

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "aggregate_loss",
    "broadcast_to_tokens",
    "entropy_from_logits",
    "gae_advantages",
    "get_kl_estimator",
    "kl_estimate",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_sum",
    "token_logprobs",
]
