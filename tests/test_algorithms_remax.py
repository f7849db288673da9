"""ReMax advantages: reward minus the greedy response's reward."""

import pytest
import torch

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.remax import REMAX, ReMaxConfig, remax_advantages

T = torch.tensor


def test_remax_subtracts_the_greedy_reward():
    # prompt 0 (greedy right, 1): samples [1, 0] -> [0, -1]; prompt 1 (greedy wrong, 0): [1, 0] -> [1, 0]
    adv = REMAX.compute(
        AdvantageInput(T([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 2), 2, baselines=T([1.0, 1.0, 0.0, 0.0])), ReMaxConfig()
    )
    torch.testing.assert_close(adv, T([0.0, -1.0, 1.0, 0.0]))
    # a singleton group still has a baseline; an all-equal group equal to its greedy reward gets 0
    torch.testing.assert_close(remax_advantages(T([0.5]), T([0.25])), T([0.25]))
    torch.testing.assert_close(remax_advantages(T([1.0, 1.0]), T([1.0, 1.0])), T([0.0, 0.0]))
    assert remax_advantages(torch.zeros(0), torch.zeros(0)).shape == (0,)


def test_remax_needs_its_baselines_and_is_registered():
    with pytest.raises(ValueError, match="greedy baselines"):
        REMAX.compute(AdvantageInput(T([1.0]), torch.ones(1, 1), 1), ReMaxConfig())
    with pytest.raises(ValueError, match=r"\(1,\) baselines for \(2,\) rewards"):
        remax_advantages(T([1.0, 0.0]), T([1.0]))
    assert ADVANTAGES.get("remax") is REMAX and REMAX.needs_greedy_baseline and not REMAX.needs_groups


def test_remax_needs_rule_rewards():
    from pathlib import Path

    from yatt.config import load_experiment
    from yatt.config_loading import ConfigError

    configs = Path(__file__).resolve().parents[1] / "configs"
    with pytest.raises(ConfigError, match="remax scores its greedy baseline responses with the rule verifier"):
        load_experiment(configs / "quickstart_genrm.yaml", ["algorithm.advantage.kind=remax"])
    assert (
        load_experiment(configs / "quickstart.yaml", ["algorithm.advantage.kind=remax"]).algorithm.advantage.kind
        == "remax"
    )
