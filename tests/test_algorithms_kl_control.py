"""KL coefficient controllers against hand-computed values."""

import pytest
from pydantic import ValidationError

from yatt.algorithms.kl_control import KLControlConfig, KLController


def test_fixed_never_moves():
    ctl = KLController(0.05, KLControlConfig())
    ctl.update(kl=3.0, samples=1000)
    assert ctl.coef == 0.05


def test_adaptive_steps():
    ctl = KLController(0.1, KLControlConfig(kind="adaptive", target_kl=0.02, horizon=1000))
    # kl .03: error .03/.02 - 1 = .5 -> clipped .2; factor 1 + .2 * 100/1000 = 1.02 -> .102
    ctl.update(kl=0.03, samples=100)
    assert ctl.coef == pytest.approx(0.102)
    # kl .015: error -.25 -> -.2; factor 1 - .2 * 500/1000 = .9 -> .0918
    ctl.update(kl=0.015, samples=500)
    assert ctl.coef == pytest.approx(0.0918)
    # kl .021: error .05 (inside the clip); factor 1 + .05 * 200/1000 = 1.01 -> .092718
    ctl.update(kl=0.021, samples=200)
    assert ctl.coef == pytest.approx(0.092718)
    # at the target the coefficient stays
    ctl.update(kl=0.02, samples=200)
    assert ctl.coef == pytest.approx(0.092718)


def test_state_round_trip_and_config_bounds():
    a = KLController(0.1, KLControlConfig(kind="adaptive"))
    a.update(kl=1.0, samples=5000)
    b = KLController(0.1, KLControlConfig(kind="adaptive"))
    b.load_state_dict(a.state_dict())
    assert b.coef == a.coef != 0.1
    with pytest.raises(ValidationError, match="target_kl"):
        KLControlConfig(kind="adaptive", target_kl=0.0)
