"""GRPO pass@k advantages (Chen et al. 2025, analytical form) against hand-computed values."""

import pytest
import torch

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.grpo_passk import GRPO_PASSK, GRPOPassKConfig, passk_advantages

T = torch.tensor


def close(a, b, atol=1e-4):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


def test_group_of_8_at_k_4():
    # 4 of 8 pass: R = 1 - C(4,4)/C(8,4) = 69/70, sigma = sqrt(69/70 * 1/70) = .118678
    #   A_pos = (1/70)/sigma = .120386; A_neg = (1/70 - C(3,3)/C(7,3) = 1/35)/sigma = -.120386
    # 1 of 8 passes: R = 1 - C(7,4)/C(8,4) = .5, sigma = .5: A_pos = 1; A_neg = (.5 - C(6,3)/C(7,3) = 4/7)/.5 = -1/7
    rewards = T([1.0] * 4 + [0.0] * 4 + [1.0] + [0.0] * 7)
    a = 0.120386
    close(passk_advantages(rewards, 8, 4), [a] * 4 + [-a] * 4 + [1.0] + [-1 / 7] * 7)


def test_solved_within_k_and_never_solved_groups_get_nothing():
    # 7 of 8 pass at k = 4: any 4 include a pass (C(1,4) = 0), R = 1, sigma = 0 -> 0; all fail: R = 0 -> 0
    close(passk_advantages(T([1.0] * 7 + [0.0] + [0.0] * 8), 8, 4), [0.0] * 16)


def test_k_1_is_grpo_with_the_population_std_and_groups_sum_to_zero():
    rewards = T([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    grouped = rewards.view(-1, 4)
    grpo = (grouped - grouped.mean(1, keepdim=True)) / grouped.std(1, unbiased=False, keepdim=True)
    close(passk_advantages(rewards, 4, 1), grpo.reshape(-1).tolist())
    sums = passk_advantages(rewards, 4, 3).view(-1, 4).sum(1)
    close(sums, [0.0, 0.0])


def test_threshold_section_and_registry():
    # reward .9 does not pass at the default threshold 1.0 (no pass: all 0); at .5 it does: k = 1 is GRPO
    assert passk_advantages(T([0.9, 0.0]), 2, 1).abs().sum() == 0
    close(passk_advantages(T([0.9, 0.0]), 2, 1, pass_threshold=0.5), [1.0, -1.0])
    with pytest.raises(ValueError, match="algorithm.advantage.k=5 must be between 1 and rollout.group_size=4"):
        passk_advantages(T([1.0, 0.0, 0.0, 0.0]), 4, 5)
    assert ADVANTAGES.get("grpo_passk") is GRPO_PASSK and GRPO_PASSK.needs_groups
    adv = GRPO_PASSK.compute(AdvantageInput(T([1.0, 0.0, 0.0, 0.0]), torch.ones(4, 1), 4), GRPOPassKConfig(k=2))
    # 1 of 4 passes, k = 2: R = 1 - C(3,2)/C(4,2) = .5, sigma = .5; A_neg = (.5 - C(2,1)/C(3,1))/.5 = -1/3
    close(adv, [1.0, -1 / 3, -1 / 3, -1 / 3])
