"""On-policy distillation advantages (Agarwal et al. 2024, GKD, arXiv 2306.13649; Thinking Machines, "On-Policy
Distillation", 2025; NeMo-RL and TRL's GKD): each response token's advantage is the teacher's log-prob of it
minus the student's, i.e. minus a one-sample estimate of the per-token reverse KL(student || teacher), optionally
plus a share of the step's reward made group-relative as in GRPO.

    A[i, t] = kl_coef x (log teacher(y_t | y_<t) - log student(y_t | y_<t)) + reward_coef x A_grpo[i]

The per-token term is not summed into returns (discount 0, as the Thinking Machines recipe does): each token is
pushed towards where the teacher puts more mass than the student, by its own log-ratio. The student's log-probs
are the engine's log-probs of the tokens it sampled (`Rollout.rollout_logprobs`), the behaviour policy whose
samples the KL is estimated on, at no extra trainer pass; they equal the trainer's within the logged
`rollout/trainer_logprob_diff_*` (about 1e-6 in float32). The teacher's are of its raw logits (yatt.genrm.teacher).
With the policy loss's ratio, the gradient is that of the reverse KL (the tinker-cookbook recipe).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor

from yatt.algorithms.advantages import broadcast_to_tokens
from yatt.algorithms.base import AdvantageEstimator, AdvantageInput, ComponentConfig
from yatt.algorithms.grpo import grpo_advantages


class DistillConfig(ComponentConfig):
    kind: Literal["distill"] = "distill"
    kl_coef: float = Field(
        1.0, ge=0.0, description="Weight of the per-token log-ratio teacher - student (the negative reverse KL)."
    )
    reward_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the step's reward (reward.kind: the rule, the judges or both) as a group-relative "
        "advantage on every token (GRPO's); 0: distil alone.",
    )
    normalize_std: bool = Field(True, description="The reward part: divide by the group std (false: Dr. GRPO).")


def distill_advantages(
    teacher: Tensor,
    student: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group_size: int,
    kl_coef: float = 1.0,
    reward_coef: float = 0.0,
    normalize_std: bool = True,
) -> Tensor:
    """[N, T] advantages: kl_coef x (teacher - student) per token, plus reward_coef x the GRPO advantage of
    `rewards` [N] on every token; 0 where `mask` is 0."""
    valid = mask.bool()
    out = (kl_coef * (teacher - student)).masked_fill(~valid, 0.0)
    if reward_coef:
        out = out + reward_coef * broadcast_to_tokens(grpo_advantages(rewards, group_size, normalize_std), mask)
    return out


def _compute(inp: AdvantageInput, cfg: DistillConfig) -> Tensor:
    if inp.teacher_logprobs is None or inp.student_logprobs is None:
        raise ValueError("algorithm.advantage.kind=distill needs the teacher's log-probs; set reward.teacher")
    return distill_advantages(
        inp.teacher_logprobs,
        inp.student_logprobs,
        inp.mask,
        inp.rewards,
        inp.group_size,
        cfg.kl_coef,
        cfg.reward_coef,
        cfg.normalize_std,
    )


# needs_groups: the reward part is group-relative (with reward_coef 0 it is unused, but groups stay whole)
DISTILL = AdvantageEstimator(config=DistillConfig, compute=_compute, needs_groups=True, needs_teacher=True)
