"""Unit tests for yatt.algorithms against hand-computed values (arithmetic shown in comments)."""

import math

import pytest
import torch

from yatt.algorithms import (
    ADVANTAGES,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    broadcast_to_tokens,
    entropy_from_logits,
    gae_advantages,
    get_kl_estimator,
    kl_estimate,
    kl_penalized_rewards,
    masked_mean,
    masked_sum,
    token_logprobs,
)
from yatt.algorithms.grpo import GRPO, grpo_advantages
from yatt.algorithms.ppo_clip import PPO_CLIP, PPOClipConfig
from yatt.algorithms.ppo_clip import ppo_clip_loss as _ppo_clip_loss


def ppo_clip_loss(logprobs, old_logprobs, advantages, mask, **kw):
    return _ppo_clip_loss(logprobs, old_logprobs, advantages, mask, PPOClipConfig(**kw))


T = torch.tensor


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, T(b, dtype=a.dtype) if not torch.is_tensor(b) else b, atol=atol, rtol=0)


# ---------------------------------------------------------------- advantages


def test_grpo_with_std():
    # group [1,0]: mean .5, unbiased std sqrt((.25+.25)/1) = .70710678 -> +-.5/.7071 = +-.70710678
    close(grpo_advantages(T([1.0, 0.0, 0.0, 1.0]), 2), [0.70710678, -0.70710678, -0.70710678, 0.70710678])
    # group [1,0,0]: mean 1/3, deviations 2/3,-1/3,-1/3; var (4/9+1/9+1/9)/2 = 1/3; std .57735027
    # 2/3/.57735 = 1.15470054, -1/3/.57735 = -.57735027
    close(grpo_advantages(T([1.0, 0.0, 0.0]), 3), [1.15470054, -0.57735027, -0.57735027])


def test_grpo_without_std():
    # r - group mean: [1,0] -> mean .5 -> [.5,-.5]; [0,1] -> [-.5,.5]
    close(grpo_advantages(T([1.0, 0.0, 0.0, 1.0]), 2, normalize_std=False), [0.5, -0.5, -0.5, 0.5])
    # [3,1,2] mean 2 -> [1,-1,0]
    close(grpo_advantages(T([3.0, 1.0, 2.0]), 3, normalize_std=False), [1.0, -1.0, 0.0])


def test_grpo_identical_and_singleton_groups_are_zero():
    adv = grpo_advantages(T([1.0, 1.0, 0.0, 0.0, 0.5, 0.5]), 2)
    assert torch.isfinite(adv).all()
    close(adv, [0.0] * 6)
    close(grpo_advantages(T([1.0, 0.0, 3.0]), 1), [0.0, 0.0, 0.0])


def test_grpo_wrong_n_raises_and_registry():
    with pytest.raises(ValueError, match="divisible"):
        grpo_advantages(T([1.0, 0.0, 1.0]), 2)
    assert ADVANTAGES.get("grpo") is GRPO and GRPO.needs_groups
    with pytest.raises(ValueError, match="unknown algorithm.advantage.kind 'nope'; registered: distill, gae, gpg, "):
        ADVANTAGES.get("nope")


# rewards [0,0,1], values [.5,.6,.8]
REW = [0.0, 0.0, 1.0]
VAL = [0.5, 0.6, 0.8]


def test_gae_gamma1_lam1():
    # deltas: t2 = 1+0-.8 = .2; t1 = 0+.8-.6 = .2; t0 = 0+.6-.5 = .1
    # A2 = .2; A1 = .2+.2 = .4; A0 = .1+.4 = .5 ; returns = A+V = [1,1,1]
    adv, ret = gae_advantages(T([REW]), T([VAL]), T([[1.0, 1.0, 1.0]]), gamma=1.0, lam=1.0)
    close(adv, T([[0.5, 0.4, 0.2]]))
    close(ret, T([[1.0, 1.0, 1.0]]))


def test_gae_gamma_half_lam_half():
    # deltas: t2 = 1+0-.8 = .2; t1 = 0+.5*.8-.6 = -.2; t0 = 0+.5*.6-.5 = -.2 ; gamma*lam = .25
    # A2 = .2; A1 = -.2+.25*.2 = -.15; A0 = -.2+.25*(-.15) = -.2375
    # returns = [-.2375+.5, -.15+.6, .2+.8] = [.2625, .45, 1.0]
    adv, ret = gae_advantages(T([REW]), T([VAL]), T([[1.0, 1.0, 1.0]]), gamma=0.5, lam=0.5)
    close(adv, T([[-0.2375, -0.15, 0.2]]))
    close(ret, T([[0.2625, 0.45, 1.0]]))


def test_gae_skips_masked_tokens():
    # Same 3 valid tokens with a masked token in the middle and at the end (garbage values there):
    # the result at valid positions equals the unmasked 3-token case, 0 elsewhere.
    rew = T([[0.0, 7.0, 0.0, 1.0, 9.0]])
    val = T([[0.5, -3.0, 0.6, 0.8, 5.0]])
    mask = T([[1, 0, 1, 1, 0]])
    adv, ret = gae_advantages(rew, val, mask, gamma=0.5, lam=0.5)
    close(adv, T([[-0.2375, 0.0, -0.15, 0.2, 0.0]]))
    close(ret, T([[0.2625, 0.0, 0.45, 1.0, 0.0]]))


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(T([2.0, -1.0]), T([[1, 1, 0], [1, 0, 0]]))
    close(out, T([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- KL


def test_kl_estimators_at_points():
    lp, ref = T([0.0, -1.0]), T([-1.0, 0.0])  # log_ratio = [1, -1]
    close(kl_estimate(lp, ref, "k1"), [1.0, -1.0])
    close(kl_estimate(lp, ref, "k2"), [0.5, 0.5])  # .5*1^2
    # k3 = exp(-lr)-1+lr: lr=1 -> e^-1 = .36787944; lr=-1 -> e-2 = .71828183
    close(kl_estimate(lp, ref, "k3"), [0.36787944, 0.71828183])


def test_kl_zero_when_equal_and_k3_nonnegative():
    x = T([-0.3, -2.0, -7.5])
    for kind in ("k1", "k2", "k3"):
        close(kl_estimate(x, x, kind), [0.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_estimate(a, b, "k3") >= 0).all()
    # clamp: lr = 100 -> 20: exp(-20)-1+20 = 19.0 -> value clamp 10; lr = -100 -> e^20-21 -> 10
    big = kl_estimate(T([100.0, -100.0]), T([0.0, 0.0]), "k3")
    close(big, [10.0, 10.0])


def test_kl_registry_unknown():
    assert callable(get_kl_estimator("k3"))
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(T([0.0]), T([0.0]), "k4")


def test_kl_penalized_rewards():
    kl = T([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    # seq0: 1 - .1*(.1+.2+.3) = .94 ; seq1: 0 - .1*(.5+.5) = -.1 (masked 9.0 ignored)
    close(kl_penalized_rewards(T([1.0, 0.0]), kl, mask, coef=0.1), [0.94, -0.1])


# ---------------------------------------------------------------- PPO clip


def _ppo(ratio, adv, **kw):
    lp = torch.log(T([ratio]))
    return ppo_clip_loss(
        lp, torch.zeros_like(lp), T(adv) if isinstance(adv, list) else T([adv]), T([[1.0] * len(ratio)]), **kw
    )


def test_ppo_inside_range_not_clipped():
    loss, st = _ppo([1.1], 2.0)  # -2*1.1 = -2.2
    close(loss, T([[-2.2]]))
    close(st["clip_frac"], 0.0)
    close(st["ratio_mean"], 1.1)


def test_ppo_positive_adv_clipped_high():
    # A=1, ratio 1.5: loss1 = -1.5, loss2 = -1.2 -> max = -1.2 (clipped)
    loss, st = _ppo([1.5], 1.0)
    close(loss, T([[-1.2]]))
    close(st["clip_frac"], 1.0)


def test_ppo_negative_adv_clipped_low():
    # A=-1, ratio .5: loss1 = .5, loss2 = .8 -> .8 (clipped)
    loss, st = _ppo([0.5], -1.0)
    close(loss, T([[0.8]]))
    close(st["clip_frac"], 1.0)
    # A=-1, ratio 1.5: loss1 = 1.5, loss2 = 1.2 -> 1.5 (pessimistic, not clipped)
    loss, st = _ppo([1.5], -1.0)
    close(loss, T([[1.5]]))
    close(st["clip_frac"], 0.0)


def test_ppo_clip_higher_asymmetry():
    # A=1, ratio 1.25: upper bound 1.28 -> not clipped, loss -1.25; with symmetric .2 -> -1.2
    loss, st = _ppo([1.25], 1.0, clip_low=0.2, clip_high=0.28)
    close(loss, T([[-1.25]]))
    close(st["clip_frac"], 0.0)
    loss, st = _ppo([1.25], 1.0, clip_low=0.2, clip_high=0.2)
    close(loss, T([[-1.2]]))
    close(st["clip_frac"], 1.0)


def test_ppo_dual_clip():
    # ratio e^3 = 20.0855: A=-1 -> loss1 = 20.0855, loss2 = 1.2, clipped 20.0855, dual bound 1*3 = 3
    # A=+1 -> max(-20.0855, -1.2) = -1.2, unchanged by dual clip
    lp = T([[3.0, 3.0]])
    loss, st = ppo_clip_loss(lp, torch.zeros_like(lp), T([[-1.0, 1.0]]), T([[1, 1]]), dual_clip=3.0)
    close(loss, T([[3.0, -1.2]]))
    close(st["dual_clip_frac"], 0.5)
    close(st["clip_frac"], 0.5)
    loss, st = ppo_clip_loss(lp, torch.zeros_like(lp), T([[-1.0, 1.0]]), T([[1, 1]]))
    close(loss, T([[math.exp(3.0), -1.2]]))
    close(st["dual_clip_frac"], 0.0)
    with pytest.raises(ValueError, match="dual_clip"):  # the config section refuses c <= 1
        ppo_clip_loss(lp, lp, T([1.0]), T([[1, 1]]), dual_clip=1.0)


def test_ppo_masked_tokens_and_stats():
    # token 0: lr .5, token 1: lr -1, token 2 masked with a huge lr
    lp = T([[0.5, -1.0, 50.0]])
    loss, st = ppo_clip_loss(lp, torch.zeros_like(lp), T([1.0]), T([[1, 1, 0]]))
    assert loss[0, 2] == 0.0
    # approx_kl = k1 = mean(old - new) = (-.5 + 1)/2 = .25; approx_kl_k2 = mean(.5*.25, .5*1) = .3125;
    # ratio_mean = (e^.5 + e^-1)/2
    close(st["approx_kl"], 0.25)
    close(st["approx_kl_k2"], 0.3125)
    close(st["ratio_mean"], (math.exp(0.5) + math.exp(-1.0)) / 2)
    # A=1: e^.5=1.6487 -> clipped to 1.2; e^-1=.3679 -> loss1 -.3679 > loss2 -.8, not clipped
    close(loss, T([[-1.2, -math.exp(-1.0), 0.0]]))
    close(st["clip_frac"], 0.5)


def test_ppo_gradient_flows():
    lp = T([[0.1, -0.2, 0.3], [0.0, 0.05, 9.0]], requires_grad=True)
    mask = T([[1, 1, 1], [1, 1, 0]])
    loss, st = ppo_clip_loss(lp, torch.zeros(2, 3), T([1.0, -0.5]), mask)
    aggregate_loss(loss, mask, "token-mean").backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    assert lp.grad[1, 2] == 0.0 and lp.grad[0, 0] != 0.0
    assert not st["clip_frac"].requires_grad
    assert POLICY_LOSSES.get("ppo_clip") is PPO_CLIP and set(st) == set(PPO_CLIP.stats)
    with pytest.raises(ValueError, match="registered: cispo, clip_cov, gmpo, gspo, kl_cov, ppo_clip, sapo"):
        POLICY_LOSSES.get("nope")


# ---------------------------------------------------------------- aggregation

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1, 1, 0], [1, 1, 1]])


def test_aggregation_modes_hand_computed():
    close(aggregate_loss(LOSS, MASK, "token-mean"), 3.6)  # (1+2+4+5+6)/5
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum"), 9.0)  # (3+15)/2
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-mean"), 3.25)  # (3/2 + 15/3)/2
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm"), 3.0)  # (3/3 + 15/3)/2
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=6), 1.5)  # (.5+2.5)/2
    close(aggregate_loss(LOSS, MASK, "token-mean", num_tokens=9.0), 2.0)  # 18/9
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=0)


def test_aggregation_microbatches_with_global_denominators():
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = T([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    num_tokens, num_seqs = float(mask.sum()), 4.0
    for mode in LOSS_AGGREGATIONS:
        full = aggregate_loss(loss, mask, mode)
        # second micro-batch is trimmed to its own max length (T=3), as a collator might do
        parts = [(loss[:2], mask[:2]), (loss[2:, :3], mask[2:, :3])]
        split = sum(
            aggregate_loss(lo, m, mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=5) for lo, m in parts
        )
        close(split, full, atol=1e-12)
    # local denominators do not add up: token-mean of the halves is not the full token-mean
    local = sum(aggregate_loss(lo, m, "token-mean") for lo, m in ((loss[:2], mask[:2]), (loss[2:], mask[2:])))
    assert not torch.allclose(local, aggregate_loss(loss, mask, "token-mean"))


def test_masked_sum_mean():
    close(masked_sum(LOSS, MASK), 18.0)
    close(masked_sum(LOSS, MASK, dim=-1), [3.0, 15.0])
    close(masked_mean(LOSS, MASK, dim=-1), [1.5, 5.0])
    close(masked_mean(T([[float("inf"), 1.0]]), T([[0, 1]])), 1.0)  # inf in padding is ignored
    close(masked_mean(LOSS, torch.zeros(2, 3)), 0.0)  # empty mask -> 0, not NaN


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(2, 3, 5)), torch.full((2, 3), math.log(5)))
    close(entropy_from_logits(T([1000.0, 1000.0, 1000.0, 1000.0])), math.log(4))  # no overflow
    close(entropy_from_logits(T([0.0, 0.0, float("-inf")])), math.log(2))  # masked vocab entry
    # p = [.75,.25] (logits [ln3, 0]): H = -(.75 ln .75 + .25 ln .25) = .56233514
    close(entropy_from_logits(T([math.log(3.0), 0.0])), 0.56233514)


def test_token_logprobs():
    # row [0,0] -> p = [.5,.5], target 1 -> ln .5 = -.69314718
    # row [ln3,0] -> p = [.75,.25], target 0 -> ln .75 = -.28768207
    logits = T([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    out = token_logprobs(logits, T([[1, 0]]))
    close(out, T([[-0.69314718, -0.28768207]]))
    # bf16 logits are upcast, output is float32 (bf16 rounds ln3, hence the looser tolerance)
    out_bf16 = token_logprobs(logits.bfloat16(), T([[1, 0]]))
    assert out_bf16.dtype == torch.float32
    close(out_bf16, T([[-0.69314718, -0.28768207]]), atol=2e-3)


def _k3_grad(log_ratio: float) -> float:
    lp = T([log_ratio], requires_grad=True)
    kl_estimate(lp, T([0.0]), "k3").sum().backward()
    return float(lp.grad[0])


def test_k3_gradient_is_bounded():
    # unbounded k3 would give 1 - e^10 = -22025 at -10 and 1 - e^19.9 = -4.4e8 at -19.9; both tokens have
    # k3 far above the clamp 10 (e^10 - 11), so their gradient is 0
    assert _k3_grad(-10.0) == 0.0 and _k3_grad(-19.9) == 0.0
    # inside the clamp the gradient is the true one: at -1, 1 - e = -1.71828183; at 2, 1 - e^-2 = .86466472
    assert abs(_k3_grad(-1.0) + 1.71828183) < 1e-5 and abs(_k3_grad(2.0) - 0.86466472) < 1e-5
    # over a fine grid of log-ratios the gradient never exceeds e^2.61 - 1 = 12.6 in magnitude
    lp = torch.linspace(-30.0, 30.0, 60001, requires_grad=True)
    kl_estimate(lp, torch.zeros(60001), "k3").sum().backward()
    assert lp.grad.abs().max() < 12.7 and lp.grad.abs().max() > 12.0
