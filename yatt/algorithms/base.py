"""What an advantage estimator and a policy loss are, so that a new one is one file and one registry line.

An entry pairs a pure function with its own config section (a pydantic model whose `kind` field is the
registry name) and the names of the statistics it reports; `yatt.algorithms.objective.Algorithm` puts the
configured pair together for the controller, which logs every declared statistic as `actor/<name>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict
from torch import Tensor

if TYPE_CHECKING:
    from yatt.distributed import World


class ComponentConfig(BaseModel):
    """Base of every algorithm component's config section; `kind` names the registry entry."""

    model_config = ConfigDict(extra="forbid")
    kind: str


@dataclass
class AdvantageInput:
    """What an estimator may read about the samples of this rank (consecutive groups of `group_size`)."""

    rewards: Tensor  # [N] sequence rewards (KL-penalised when algorithm.kl_mode = reward)
    mask: Tensor  # [N, T] response tokens
    group_size: int
    world: World | None = None  # for estimators that normalise over the global batch
    # [N, T] kl_coef * per-token KL to the reference when algorithm.kl_mode = reward (else None); `rewards`
    # already subtract its sum over each sequence, for estimators that shape token rewards with it instead
    token_kl: Tensor | None = None
    # [N] reward of each sample's prompt's greedy response (estimators with needs_greedy_baseline), else None
    baselines: Tensor | None = None
    # [N, T] the critic's value of each response token's prefix, 0 outside the mask (estimators with
    # needs_values), else None
    values: Tensor | None = None
    # [N, T] on-policy distillation (estimators with needs_teacher): the teacher's log-prob of each response token,
    # and the student's, the engine's log-prob of the token it sampled; 0 outside the mask; else None
    teacher_logprobs: Tensor | None = None
    student_logprobs: Tensor | None = None


@dataclass(frozen=True)
class AdvantageEstimator:
    config: type[ComponentConfig]
    # (input, its config) -> advantages [N] (per sequence) or [N, T] (per token); with needs_values
    # (advantages [N, T], the critic's regression targets [N, T])
    compute: Callable[[AdvantageInput, Any], Tensor | tuple[Tensor, Tensor]]
    needs_groups: bool  # advantages relative to the group: each prompt's samples must stay on one rank
    # the controller generates one greedy response per prompt with its group and passes its reward (ReMax)
    needs_greedy_baseline: bool = False
    # reads a critic's per-token values (AdvantageInput.values): the run trains a value model (critic.*)
    needs_values: bool = False
    # reads a teacher's per-token log-probs (AdvantageInput.teacher_logprobs): the run serves reward.teacher
    needs_teacher: bool = False


@dataclass(frozen=True)
class PolicyLoss:
    config: type[ComponentConfig]
    # (logprobs, old_logprobs, advantages, mask, its config) -> (per-token loss [B, T], 0 where masked;
    # {stat: masked mean over this micro-batch's response tokens}): one signature for every loss
    compute: Callable[[Tensor, Tensor, Tensor, Tensor, Any], tuple[Tensor, dict[str, Tensor]]]
    stats: tuple[str, ...]  # the keys of the stats dict, logged as actor/<stat> (token-weighted means)
