"""PPO's clipped value loss against hand-computed values, gradients and edge cases."""

import torch

from yatt.algorithms.value_loss import clipped_value_loss

T = torch.tensor


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, b if torch.is_tensor(b) else T(b, dtype=a.dtype), atol=atol, rtol=0)


# token 0 overshoots away from R (plain error wins), token 1 moved towards R past the clip (clipped error
# wins: no gradient), token 2 did not move (both equal)
V, OLD, R = [1.0, 0.9, 0.5], [0.5, 0.0, 0.5], [0.0, 1.0, 0.6]


def test_clipped_value_loss_by_hand():
    values = T([V], requires_grad=True)
    loss, stats = clipped_value_loss(values, T([OLD]), T([R]), torch.ones(1, 3), clip=0.2)
    # plain (V-R)^2 = [1, .01, .01]; clipped: old + clip(V-old, +-.2) = [.7, .2, .5] -> [.49, .64, .01]
    close(loss, [[0.5, 0.32, 0.005]])
    close(stats["vf_clipfrac"], T(1 / 3))
    close(stats["value_pred_mean"], T(0.8))
    loss.sum().backward()
    close(values.grad, [[1.0, 0.0, -0.1]])  # d 0.5(V-R)^2 / dV = V - R where the plain error is taken


def test_unclipped_is_half_the_squared_error():
    loss, stats = clipped_value_loss(T([V]), T([OLD]), T([R]), torch.ones(1, 3), clip=None)
    close(loss, [[0.5, 0.005, 0.005]])
    close(stats["vf_clipfrac"], T(0.0))


def test_masked_tokens_contribute_nothing_even_if_not_finite():
    values = T([[1.0, float("inf")], [float("nan"), 2.0]], requires_grad=True)
    mask = T([[1.0, 0.0], [0.0, 1.0]])
    loss, stats = clipped_value_loss(values, T([[1.0, 0.0], [0.0, 1.5]]), T([[0.0, 0.0], [0.0, 1.0]]), mask, 0.2)
    close(loss, [[0.5, 0.0], [0.0, 0.5]])  # token (1,1): plain .5 * 1, clipped (1.7 - 1)^2 = .49 -> .5
    close(stats["value_pred_mean"], T(1.5))
    loss.sum().backward()
    assert torch.isfinite(values.grad).all()


def test_all_masked_and_empty():
    loss, stats = clipped_value_loss(T([[3.0, 4.0]]), T([[0.0, 0.0]]), T([[1.0, 1.0]]), torch.zeros(1, 2), 0.2)
    close(loss, [[0.0, 0.0]])
    assert float(stats["vf_clipfrac"]) == 0.0 and float(stats["value_pred_mean"]) == 0.0
    loss, _ = clipped_value_loss(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), 0.2)
    assert loss.shape == (0, 4)
