"""The Algorithm objective: IS weights, entropy bonus and the controlled KL coefficient, by hand."""

import math

import pytest
import torch

from yatt.algorithms.objective import Algorithm
from yatt.config import AlgorithmConfig
from yatt.tensors import TokenBatch

T = torch.tensor
MASK = T([[1.0, 1.0], [1.0, 0.0]])
ENTROPY = T([[1.0, 2.0], [3.0, 9.0]])


def micro_batch(rows=slice(None)) -> TokenBatch:
    extras = {
        "old_logprobs": torch.zeros(2, 2),
        "advantages": T([1.0, -2.0]),
        # engine log-probs: ratios exp(old - rollout) = [e, .5], [1, (masked)]
        "rollout_logprobs": T([[-1.0, math.log(2.0)], [0.0, 0.0]]),
        "ref_logprobs": T([[0.0, -1.0], [1.0, 0.0]]),
    }
    mb = TokenBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), MASK, extras)
    return mb.select(torch.arange(2)[rows])


def test_is_weights_and_entropy_bonus():
    algo = Algorithm(AlgorithmConfig(entropy_coef=0.1, rollout_is={"mode": "truncate"}))
    assert algo.needs_entropy and "entropy_bonus" in algo.stats
    loss_fn = algo.objective(num_tokens=3.0, num_seqs=2.0, norm_length=2)
    # ratio 1: ppo loss -A -> [-1,-1],[2,.]; x IS weights min([e,.5],[1], 2) = [2,.5],[1]
    # -> [-2,-.5],[2]; -.1 x entropy [1,2],[3]
    # -> [-2.1,-.7],[1.7]: token-mean over 3 tokens = -1.1/3
    loss, sums = loss_fn(torch.zeros(2, 2), ENTROPY, micro_batch())
    assert loss.item() == pytest.approx(-1.1 / 3)
    assert sums["policy_loss"] == pytest.approx(-0.5) and sums["entropy_bonus"] == pytest.approx(6.0)
    # micro-batches with the global denominators add up to the whole
    parts = [loss_fn(torch.zeros(1, 2), ENTROPY[[i]], micro_batch(slice(i, i + 1)))[0] for i in (0, 1)]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="with_entropy=True"):
        loss_fn(torch.zeros(2, 2), None, micro_batch())


def test_entropy_gradient_and_no_bonus_by_default():
    algo = Algorithm(AlgorithmConfig(entropy_coef=0.5))
    ent = ENTROPY.clone().requires_grad_(True)
    loss, _ = algo.objective(3.0, 2.0, 2)(torch.zeros(2, 2), ent, micro_batch())  # no IS correction
    loss.backward()
    torch.testing.assert_close(ent.grad, T([[-0.5 / 3, -0.5 / 3], [-0.5 / 3, 0.0]]))  # maximise entropy
    plain = Algorithm(AlgorithmConfig())
    assert not plain.needs_entropy and "entropy_bonus" not in plain.stats


def test_kl_loss_uses_the_controlled_coefficient():
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_control={"kind": "adaptive", "target_kl": 0.01, "horizon": 100}))
    mb = micro_batch()
    logp = torch.zeros(2, 2)
    # k3 of log-ratios [0, 1],[-1]: 0, e^-1 - 1 + 1 = .367879, e - 2 = .718282; ppo part -1 -1 +2 = 0
    loss, sums = algo.objective(3.0, 2.0, 2)(logp, None, mb)
    assert sums["kl_loss"] == pytest.approx(1.086161, abs=1e-5)
    assert loss.item() == pytest.approx(0.1 * 1.086161 / 3, abs=1e-6)
    algo.kl_control.update(kl=1.0, samples=100)  # error clipped to .2: coef x 1.2
    assert algo.kl_coef == pytest.approx(0.12)
    loss, _ = algo.objective(3.0, 2.0, 2)(logp, None, mb)
    assert loss.item() == pytest.approx(0.12 * 1.086161 / 3, abs=1e-6)
