"""Rollout importance-sampling correction (truncated / masked, token / sequence / geometric) by hand."""

import math

import pytest
import torch
from pydantic import ValidationError

from yatt.algorithms.rollout_is import RolloutISConfig, correction_weights, is_ratios, mismatch_metrics

T = torch.tensor
E = math.e
# trainer log-probs minus engine log-probs: row 0 [1, 0, -1], row 1 [-1, -1, (masked)]
OLD = T([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
ROLL = T([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b if torch.is_tensor(b) else T(b, dtype=a.dtype), atol=atol, rtol=0)


def rollout_correction(old, roll, mask, cfg):
    return correction_weights(old, roll, mask, cfg), mismatch_metrics(old, roll, mask, cfg)


def weights(**kw):
    return rollout_correction(OLD, ROLL, MASK, RolloutISConfig(**kw))


def test_ratios_per_level():
    close(is_ratios(OLD, ROLL, MASK, "token"), [[E, 1.0, 1 / E], [1 / E, 1 / E, 1.0]])
    close(is_ratios(OLD, ROLL, MASK, "sequence"), [[1.0, 1.0, 1.0], [E**-2, E**-2, 1.0]])  # exp(0), exp(-2)
    close(is_ratios(OLD, ROLL, MASK, "geometric"), [[1.0, 1.0, 1.0], [1 / E, 1 / E, 1.0]])  # exp(0), exp(-1)


def test_truncated_is():
    w, m = weights(mode="truncate", threshold=2.0)  # min(ratio, 2)
    close(w, [[2.0, 1.0, 1 / E], [1 / E, 1 / E, 0.0]])
    close(T(m["rollout_is/changed_frac"]), 0.2)  # only the e token was truncated
    w, m = weights(mode="truncate", level="sequence", threshold=2.0)
    close(w, [[1.0, 1.0, 1.0], [E**-2, E**-2, 0.0]])
    assert m["rollout_is/changed_frac"] == 0.0


def test_masked_is():
    w, m = weights(mode="mask", threshold=2.0)  # keep [1/2, 2]: drops e, and the three 1/e tokens
    close(w, [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(T(m["rollout_is/changed_frac"]), 0.8)
    w, m = weights(mode="mask", level="sequence", threshold=2.0)  # row 1's e^-2 < 1/2: the sequence goes
    close(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(T(m["rollout_is/changed_frac"]), 0.4)
    w, _ = weights(mode="mask", level="geometric", threshold=2.0, lower_threshold=0.3)  # e^-1 = .37 kept
    close(w, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    with pytest.raises(ValidationError, match="lower_threshold applies to mode=mask"):
        RolloutISConfig(mode="truncate", lower_threshold=0.5)
    with pytest.raises(ValidationError, match="threshold"):
        RolloutISConfig(threshold=1.0)


def test_metrics_and_no_correction_mode():
    w, m = weights()  # none: no weights, but the mismatch is measured
    assert w is None
    close(T(m["rollout_is/ratio_mean"]), (E + 1 + 3 / E) / 5)
    close(T(m["rollout_is/mismatch_kl"]), ((E - 2) + 3 / E) / 5)  # r-1-log r: e-2, 0, and 1/e three times
    close(T(m["rollout_is/ratio_max"]), E)
    close(T(m["rollout_is/ratio_min"]), 1 / E)
    assert m["rollout_is/changed_frac"] == 0.0 and m["rollout_is/weight_mean"] == 1.0


def test_all_masked_and_extreme_log_ratios():
    w, m = rollout_correction(OLD, ROLL, torch.zeros(2, 3), RolloutISConfig(mode="truncate"))
    close(w, torch.zeros(2, 3))
    assert all(v == 0.0 for v in m.values())
    w, m = rollout_correction(T([[100.0, -100.0]]), T([[0.0, 0.0]]), T([[1.0, 1.0]]), RolloutISConfig(mode="truncate"))
    close(w, [[2.0, math.exp(-20.0)]])  # log-ratios clamped to +-20 before exp
    assert all(math.isfinite(v) for v in m.values())
    w, _ = rollout_correction(
        T([[100.0, -100.0]]), T([[0.0, 0.0]]), T([[1.0, 1.0]]), RolloutISConfig(mode="mask", level="sequence")
    )
    close(w, [[1.0, 1.0]])  # the sequence's log-ratio sums to 0: kept


def test_modes_survive_yaml():
    # YAML 1.1 reads a bare `off` as false: the no-correction mode is called `none` so a config can name it
    import yaml

    for mode in ("none", "truncate", "mask"):
        assert RolloutISConfig(**yaml.safe_load(f"mode: {mode}")).mode == mode
