"""GPG advantages (group-centred, alpha = B / (B - M)) against hand-computed values."""

import torch

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.gpg import GPG, GPGConfig, gpg_advantages

T = torch.tensor


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, T(b, dtype=a.dtype), atol=atol, rtol=0)


class OtherRank:
    """A data-parallel world whose other rank holds `samples` samples, `invalid` of them in all-equal groups
    (unit-tests the global count without starting a process group)."""

    def __init__(self, samples: float, invalid: float):
        self.other = [samples, invalid]

    def sum(self, values):
        return [a + b for a, b in zip(values, self.other)]


def test_centred_without_std_and_scaled_by_the_valid_share():
    # groups [1,0,1] and [1,0,0]: every group varies, alpha = 1 -> r - mean
    close(gpg_advantages(T([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), 3), [1 / 3, -2 / 3, 1 / 3, 2 / 3, -1 / 3, -1 / 3])
    # groups [1,0] and [1,1]: B = 4, M = 2 -> alpha = 2: [.5, -.5] * 2; the all-equal group stays 0
    close(gpg_advantages(T([1.0, 0.0, 1.0, 1.0]), 2), [1.0, -1.0, 0.0, 0.0])
    # F_norm = std: [1, 0] has unbiased std .7071 -> +-.5/.7071 = +-.7071, times alpha 2
    close(gpg_advantages(T([1.0, 0.0, 1.0, 1.0]), 2, normalize_std=True), [1.41421, -1.41421, 0.0, 0.0], atol=1e-4)


def test_alpha_counts_every_rank():
    # this rank: [1, 0] (B 2, M 0); the other: 6 samples, 4 invalid -> B = 8, M = 4, alpha = 2
    close(gpg_advantages(T([1.0, 0.0]), 2, world=OtherRank(6.0, 4.0)), [1.0, -1.0])
    # this rank holds nothing, the other rank all-invalid samples: alpha falls back to 1 (nothing to scale)
    assert gpg_advantages(torch.zeros(0), 2, world=OtherRank(4.0, 4.0)).shape == (0,)
    close(gpg_advantages(T([0.0, 0.0]), 2), [0.0, 0.0])


def test_registered_with_its_section():
    assert ADVANTAGES.get("gpg") is GPG and GPG.needs_groups and not GPGConfig().normalize_std
    adv = GPG.compute(AdvantageInput(T([1.0, 0.0, 0.0, 0.0]), torch.ones(4, 2), 2), GPGConfig())
    close(adv, [1.0, -1.0, 0.0, 0.0])  # [1,0] -> +-.5, alpha = 4/2
