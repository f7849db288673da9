"""GSPO's sequence-level ratio and clipping against hand-computed values."""

import math

import torch

from yatt.algorithms import POLICY_LOSSES, aggregate_loss
from yatt.algorithms.gspo import GSPO, GSPOConfig, gspo_loss

T = torch.tensor
WIDE = GSPOConfig(clip_low=0.2, clip_high=0.2)


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b if torch.is_tensor(b) else T(b, dtype=a.dtype), atol=atol, rtol=0)


def test_sequence_ratio_and_clipping():
    # seq 0: log-ratios [.1,.3] -> mean .2 -> s = e^.2 = 1.22140 > 1.2 with A = 1 -> clipped, -1.2 per token
    # seq 1: log-ratios [-.1, (masked 99)] -> s = e^-.1 = .904837, A = -1: max(.904837, .904837) -> .904837
    lp = T([[0.1, 0.3], [-0.1, 99.0]])
    loss, st = gspo_loss(lp, torch.zeros(2, 2), T([1.0, -1.0]), T([[1.0, 1.0], [1.0, 0.0]]), WIDE)
    close(loss, [[-1.2, -1.2], [math.exp(-0.1), 0.0]])
    close(st["clip_frac"], 2 / 3)  # 2 of the 3 valid tokens belong to the clipped sequence
    close(st["ratio_mean"], (2 * math.exp(0.2) + math.exp(-0.1)) / 3)
    # k1 of the sequence ratios, over tokens: -(.2 + .2 - .1)/3 = -.1; k2: .5 * (.04 + .04 + .01)/3 = .015
    close(st["approx_kl"], -0.1)
    close(st["approx_kl_k2"], 0.015)
    assert POLICY_LOSSES.get("gspo") is GSPO and set(st) == set(GSPO.stats)


def test_gradient_is_sequence_ratio_times_token_score():
    # inside the clip every token's gradient is -A * s; seq-mean-token-mean divides by the 3 tokens and 1 seq
    # log-ratios [.01,-.02,.04] -> mean .01 -> s = e^.01 = 1.0100502; A = 2 -> -2 * 1.0100502 / 3 = -.6733668
    lp = T([[0.01, -0.02, 0.04]], requires_grad=True)
    mask = torch.ones(1, 3)
    loss, _ = gspo_loss(lp, torch.zeros(1, 3), T([2.0]), mask, GSPOConfig(clip_low=0.1, clip_high=0.1))
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    close(lp.grad, [[-0.6733668] * 3])
    # clipped (default clip 4e-4): no gradient at all
    lp.grad = None
    loss, st = gspo_loss(lp, torch.zeros(1, 3), T([2.0]), mask, GSPOConfig())
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    close(lp.grad, [[0.0] * 3])
    close(st["clip_frac"], 1.0)


def test_empty_rows_extreme_ratios_and_micro_batches():
    lp = T([[50.0, 50.0, 0.0], [0.0, 0.0, 0.0], [0.2, -0.1, 0.3], [-60.0, 0.0, 0.0]], requires_grad=True)
    mask = T([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    adv = T([1.0, 1.0, -0.5, -1.0])
    loss, st = gspo_loss(lp, torch.zeros(4, 3), adv, mask, WIDE)
    assert torch.isfinite(loss).all() and all(torch.isfinite(v) for v in st.values())
    close(loss[1], [0.0, 0.0, 0.0])  # the empty row
    # seq 0: log-ratio 50 -> s capped at e^10, A = 1 -> clipped at 1.2; seq 3: s = e^-60 ~ 0, A = -1 -> .8
    close(loss[0], [-1.2, -1.2, 0.0])
    close(loss[3], [0.8, 0.0, 0.0])
    # each row depends only on itself: any split into micro-batches gives the same per-token losses
    parts = [gspo_loss(lp[i : i + 2], torch.zeros(2, 3), adv[i : i + 2], mask[i : i + 2], WIDE)[0] for i in (0, 2)]
    close(torch.cat(parts), loss)
