"""On-policy distillation advantages (yatt.algorithms.distill) against hand-computed values."""

import pytest
import torch

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.distill import DISTILL, DistillConfig, distill_advantages

T = torch.tensor


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


# two samples of one prompt; sample 1 has two response tokens (the third position is padding)
TEACHER = T([[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]])
STUDENT = T([[-1.5, -0.25, -0.5], [-0.2, -1.0, 0.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
REWARDS = T([1.0, 0.0])


def test_the_advantage_is_teacher_minus_student_per_token():
    # -0.5 - -1.5 = 1.0; -1.0 - -0.25 = -0.75; -2.0 - -0.5 = -1.5 | -0.1 - -0.2 = 0.1; -3 - -1 = -2; padding 0
    close(distill_advantages(TEACHER, STUDENT, MASK, REWARDS, 2), [[1.0, -0.75, -1.5], [0.1, -2.0, 0.0]])
    # kl_coef scales it: 0.5 x the above
    half = distill_advantages(TEACHER, STUDENT, MASK, REWARDS, 2, kl_coef=0.5)
    close(half, [[0.5, -0.375, -0.75], [0.05, -1.0, 0.0]])


def test_the_reward_part_is_grpo_on_every_token():
    # GRPO of [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> +-0.70711 (eps 1e-6 aside);
    # times reward_coef 2 -> +-1.41421 on every valid token, added to the per-token log-ratios
    a = 2 * 0.5 / (0.5**0.5 + 1e-6)
    got = distill_advantages(TEACHER, STUDENT, MASK, REWARDS, 2, kl_coef=1.0, reward_coef=2.0)
    close(got, [[1.0 + a, -0.75 + a, -1.5 + a], [0.1 - a, -2.0 - a, 0.0]], atol=1e-5)
    # without the std (Dr. GRPO): +-0.5 x 2 = +-1
    got = distill_advantages(TEACHER, STUDENT, MASK, REWARDS, 2, kl_coef=0.0, reward_coef=2.0, normalize_std=False)
    close(got, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])


def test_registry_and_its_input():
    assert ADVANTAGES.get("distill") is DISTILL and DISTILL.needs_teacher and DISTILL.needs_groups
    inp = AdvantageInput(REWARDS, MASK, 2, teacher_logprobs=TEACHER, student_logprobs=STUDENT)
    close(DISTILL.compute(inp, DistillConfig(kl_coef=2.0)), [[2.0, -1.5, -3.0], [0.2, -4.0, 0.0]])
    with pytest.raises(ValueError, match="reward.teacher"):
        DISTILL.compute(AdvantageInput(REWARDS, MASK, 2), DistillConfig())
