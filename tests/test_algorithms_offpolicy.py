"""The newer policy losses against values computed by hand: CISPO, SAPO, GMPO, Clip-Cov, KL-Cov (each with its
gradient where the loss is about the gradient), chosen by name from the config like the others."""

from __future__ import annotations

import math

import pytest
import torch

from yatt.algorithms import POLICY_LOSSES
from yatt.algorithms.cispo import CISPOConfig, cispo_loss
from yatt.algorithms.clip_cov import ClipCovConfig, clip_cov_loss
from yatt.algorithms.gmpo import GMPOConfig, gmpo_loss
from yatt.algorithms.kl_cov import KLCovConfig, kl_cov_loss
from yatt.algorithms.sapo import SAPOConfig, sapo_loss
from yatt.config import AlgorithmConfig

LN = math.log


def tokens(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # ratios 2 and 0.5 (both outside [0.8, 1.2]), a padded third token
    logp = tokens([LN(0.5), LN(0.2), 0.0]).requires_grad_()
    old = tokens([LN(0.25), LN(0.4), 0.0])
    mask = tokens([1, 1, 0])
    loss, stats = cispo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, CISPOConfig())
    want = [-1.2 * LN(0.5), -0.8 * LN(0.2), 0.0]
    assert torch.allclose(loss, tokens(want))
    loss.sum().backward()
    assert torch.allclose(logp.grad, tokens([-1.2, -0.8, 0.0]))  # -sg(w) * A: PPO would give these tokens 0
    assert float(stats["clip_frac"]) == 1.0 and math.isclose(float(stats["ratio_mean"]), 1.25)


def test_sapo_gates_softly_with_a_temperature_by_the_advantage_sign():
    logp = tokens([LN(0.5), LN(0.2)], [LN(0.3), LN(0.3)]).requires_grad_()
    old = tokens([LN(0.25), LN(0.4)], [LN(0.3), LN(0.3)])
    mask = tokens([1, 1], [1, 1])
    cfg = SAPOConfig(tau_pos=1.0, tau_neg=2.0)
    loss, stats = sapo_loss(logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, cfg)

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    # row 0 (A = 1, tau 1): ratios 2 and 0.5; row 1 (A = -1, tau 2): on-policy, the gate is 4/2 * sigmoid(0) = 1
    want = [[-4 * sigmoid(1.0), -4 * sigmoid(-0.5)], [1.0, 1.0]]
    assert torch.allclose(loss, tokens(*want))
    loss.sum().backward()
    # d/dlogp of -A * f(r) = -A * 4 * sigmoid'(tau (r - 1)) * r: at r = 1 exactly the policy gradient, -A
    assert torch.allclose(logp.grad[1], tokens([1.0, 1.0]))
    grad = [-4 * sigmoid(1.0) * (1 - sigmoid(1.0)) * 2, -4 * sigmoid(-0.5) * (1 - sigmoid(-0.5)) * 0.5]
    assert torch.allclose(logp.grad[0], tokens(grad))
    assert math.isclose(float(stats["gate_mean"]), (4 * sigmoid(1.0) + 4 * sigmoid(-0.5) + 2) / 4)


def test_gmpo_takes_the_geometric_mean_of_pessimistically_clipped_ratios():
    # row 0: A = 1, log-ratios ln2 (clipped to 0.4) and ln0.5 (kept: the pessimistic side); row 1: A = -1, the same
    # log-ratios: ln2 kept and ln0.5 clipped to -0.4; row 2: no response tokens
    logp = tokens([LN(0.5), LN(0.2)], [LN(0.5), LN(0.2)], [0.0, 0.0])
    old = tokens([LN(0.25), LN(0.4)], [LN(0.25), LN(0.4)], [0.0, 0.0])
    mask = tokens([1, 1], [1, 1], [0, 0])
    loss, stats = gmpo_loss(logp, old, torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64), mask, GMPOConfig())
    r0, r1 = math.exp((0.4 + LN(0.5)) / 2), math.exp((LN(2) - 0.4) / 2)
    assert torch.allclose(loss, tokens([-r0, -r0], [r1, r1], [0.0, 0.0]))
    assert float(stats["clip_frac"]) == 1.0  # both tokens of both rows are outside [-0.4, 0.4]


def test_clip_cov_cuts_the_gradient_of_picked_tokens_only_and_the_same_ones_again():
    torch.manual_seed(0)
    logp = (torch.randn(4, 50, dtype=torch.float64) - 2).requires_grad_()
    old = logp.detach() + 0.01 * torch.randn(4, 50, dtype=torch.float64)  # near on-policy: nothing PPO-clipped
    adv = torch.tensor([3.0, -3.0, 2.0, -2.0], dtype=torch.float64)
    mask = torch.ones(4, 50, dtype=torch.float64)
    cfg = ClipCovConfig(cov_ratio=0.02, cov_lower=0.5, cov_upper=50.0)  # 4 of 200 tokens
    loss, stats = clip_cov_loss(logp, old, adv, mask, cfg)
    assert math.isclose(float(stats["cov_cut_frac"]), 4 / 200) and float(stats["clip_frac"]) == 0.0
    cut = loss.detach() == 0
    assert int(cut.sum()) == 4
    ratio = torch.exp(logp.detach() - old)
    assert torch.allclose(loss.detach()[~cut], (-adv[:, None] * ratio)[~cut])  # PPO's loss everywhere else
    again, _ = clip_cov_loss(logp, old, adv, mask, cfg)
    assert torch.equal(again.detach() == 0, cut)  # the same tokens: seeded by the batch, not the global RNG
    cov = (adv[:, None] - adv.mean()) * (logp.detach() - logp.detach().mean())
    assert bool(((cov[cut] > 0.5) & (cov[cut] < 50.0)).all())


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    logp = tokens([LN(0.5), LN(0.1)], [LN(0.2), LN(0.9)])
    old = tokens([LN(0.25), LN(0.1)], [LN(0.4), LN(0.9)])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = tokens([1, 1], [1, 1])
    loss, stats = kl_cov_loss(logp, old, adv, mask, KLCovConfig(cov_ratio=0.25, kl_coef=0.5))  # 1 of 4 tokens
    # mean A = 0, mean logp = (ln .5 + ln .1 + ln .2 + ln .9) / 4; the covariance is largest for row 0's first token
    mean = (LN(0.5) + LN(0.1) + LN(0.2) + LN(0.9)) / 4
    cov = [[(LN(0.5) - mean), (LN(0.1) - mean)], [-(LN(0.2) - mean), -(LN(0.9) - mean)]]
    assert max(max(row) for row in cov) == cov[0][0]
    want = [[-2.0 + 0.5 * LN(2), -1.0], [0.5, 1.0]]
    assert torch.allclose(loss, tokens(*want))
    assert float(stats["kl_frac"]) == 0.25


@pytest.mark.parametrize("kind", ["cispo", "sapo", "gmpo", "clip_cov", "kl_cov"])
def test_each_is_a_registered_policy_loss_the_config_names(kind):
    cfg = AlgorithmConfig.model_validate({"policy_loss": kind})
    entry = POLICY_LOSSES.get(kind)
    assert isinstance(cfg.policy_loss, entry.config) and cfg.policy_loss.kind == kind
    logp = torch.randn(2, 3, dtype=torch.float64)
    loss, stats = entry.compute(logp, logp, torch.ones(2, dtype=torch.float64), torch.ones(2, 3), cfg.policy_loss)
    assert loss.shape == (2, 3) and set(stats) == set(entry.stats)
