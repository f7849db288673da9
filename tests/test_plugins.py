"""Plug-ins by import path from the config: a verifier and an advantage estimator defined in tests/plugins/ (one
file each, nothing else edited) run through `ControllerShard.step()`, a verifier from a file outside yatt and
tests/, and the one-line errors of an import path that does not load."""

from __future__ import annotations

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, experiment
from test_shard_step import WORLD, fake_shard
from transformers import AutoTokenizer

from yatt.config import load_experiment
from yatt.config_loading import ConfigError, dump_config
from yatt.data.errors import DataError
from yatt.data.prepare import load_rank_data
from yatt.rewards.rules import RULES, score


@pytest.fixture(autouse=True)
def own_rules(monkeypatch):
    """reward.verifiers register into the process's RULES; each test gets its own copy."""
    monkeypatch.setattr(RULES, "_entries", dict(RULES._entries))


def test_a_verifier_from_tests_scores_the_rows_of_its_data_source(tmp_path):
    with fake_shard(
        tmp_path,
        "reward.verifiers.even_digit=tests.plugins.my_verifier:even_digit",
        "data.train.data_source=even_digit",
    ) as (shard, _):
        result = shard.step(1)
        # the fake engine answers 0..7 to every prompt: 4 even digits in each group (exact_match: 1 in 8)
        assert result.metrics["reward/mean"] == 0.5 and result.metrics["actor/grad_norm"] > 0
        assert all(r.reward == float(r.text in "0246") for r in result.rollouts)
        assert {r.row.data_source for r in result.rollouts} == {"even_digit"}


def test_an_advantage_estimator_from_tests_gets_its_own_section_and_trains(tmp_path, monkeypatch):
    from tests.plugins.my_advantage import ESTIMATOR, ScaledCenteredConfig

    kind = "tests.plugins.my_advantage:ESTIMATOR"
    with fake_shard(tmp_path, f"algorithm.advantage.kind={kind}", "algorithm.advantage.scale=3") as (shard, _):
        section = shard.cfg.algorithm.advantage
        assert shard.algorithm.estimator is ESTIMATOR
        assert type(section) is ScaledCenteredConfig and section.scale == 3.0 and section.kind == kind
        seen = []
        advantages = shard.algorithm.advantages
        monkeypatch.setattr(shard.algorithm, "advantages", lambda inp: seen.append(advantages(inp)) or seen[-1])
        before = {name: t.clone() for name, t in shard.trainer.named_weights()}
        metrics = shard.step(1).metrics
        # prompt "0+b=" gets samples 0..7, sample b right: 3 * (one-hot - 1/8) per group
        want = torch.tensor([3.0 * (float(j == b) - 1 / 8) for b in range(8) for j in range(8)])
        torch.testing.assert_close(seen[0][0], want)
        assert metrics["actor/grad_norm"] > 0
        assert any(not torch.equal(before[k], t) for k, t in shard.trainer.named_weights())
        # the resolved config (written to the run directory) loads back to the same plug-in section
        dump_config(shard.cfg, tmp_path / "resolved.yaml")
        assert load_experiment(tmp_path / "resolved.yaml").algorithm.advantage == section


OUTSIDE = """
def ends_in_seven(response, row):
    return float(response.strip().endswith("7"))
"""


def test_a_verifier_from_a_file_outside_yatt_and_tests(tmp_path, monkeypatch):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "outside_rewards.py").write_text(OUTSIDE)
    monkeypatch.syspath_prepend(str(tmp_path / "outside"))
    with fake_shard(
        tmp_path, "reward.verifiers.sevens=outside_rewards:ends_in_seven", "data.train.data_source=sevens"
    ) as (shard, _):
        rollouts = shard.step(1).rollouts
        # every prompt's sample "7" scores 1, whatever the prompt's own answer (exact_match: only "0+7=")
        assert sorted({(r.text, r.reward) for r in rollouts}) == [(str(j), float(j == 7)) for j in range(8)]


def rank_data(config, *overrides):
    cfg = load_experiment(config, list(overrides))
    return load_rank_data(cfg.data, WORLD, AutoTokenizer.from_pretrained(str(cfg.model.path)), cfg.reward.verifiers)


def test_a_data_source_may_be_an_import_path_itself(tmp_path, monkeypatch):
    (tmp_path / "outside_direct.py").write_text(OUTSIDE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = rank_data(experiment(tmp_path, ONE_TOKEN_GRPO), "data.eval.data_source=outside_direct:ends_in_seven")
    assert [score("7", row) for row in data.eval[:2]] == [1.0, 1.0] and score("4", data.eval[0]) == 0.0
    assert score("7", data.train[0]) == float(data.train[0].answer == "7")  # train rows keep exact_match


def test_an_import_path_that_does_not_load_is_one_line_naming_the_field_and_the_path(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = experiment(tmp_path, ONE_TOKEN_GRPO)
    # reward.verifiers: the config check imports nothing; reading the data (before any engine) does
    cfg = load_experiment(config, ["reward.verifiers.mine=broken_rewards:score"])
    assert cfg.reward.verifiers == {"mine": "broken_rewards:score"}
    cases = {
        (
            "reward.verifiers.mine=broken_rewards:score",
        ): "reward.verifiers.mine: cannot import 'broken_rewards' (from 'broken_rewards:score'): RuntimeError: "
        "no GPU here",
        (
            "reward.verifiers.mine=nowhere_pkg.rewards:score",
        ): "reward.verifiers.mine: cannot import 'nowhere_pkg.rewards' (from 'nowhere_pkg.rewards:score'): No "
        "module named 'nowhere_pkg'",
        (
            "reward.verifiers.mine=tests.plugins.my_verifier:odd_digit",
        ): "reward.verifiers.mine: 'tests.plugins.my_verifier' has no attribute 'odd_digit' (from "
        "'tests.plugins.my_verifier:odd_digit')",
        (
            "data.train.data_source=mine",
        ): "no verifier for data_source 'mine'; registered: addition, exact_match, last_number, reasoning_gym/",
    }
    for overrides, message in cases.items():
        with pytest.raises(DataError) as err:
            rank_data(config, *overrides)
        assert message in str(err.value) and "\n" not in str(err.value), (overrides, str(err.value))
    assert str(err.value).startswith(f"{tmp_path / 'train.jsonl'}:1: ")  # the first row of that data_source
    with pytest.raises(ConfigError, match="reward.verifiers.mine: 'broken_rewards' is not an import path"):
        load_experiment(config, ["reward.verifiers.mine=broken_rewards"])
    # the algorithm's plug-ins are imported when the config is checked: a config error naming field and path
    cases = {
        "algorithm.advantage.kind=nowhere_pkg:ESTIMATOR": (
            "algorithm.advantage.kind: cannot import 'nowhere_pkg' (from 'nowhere_pkg:ESTIMATOR')"
        ),
        "algorithm.policy_loss.kind=broken_rewards:LOSS": (
            "algorithm.policy_loss.kind: cannot import 'broken_rewards' (from 'broken_rewards:LOSS'): RuntimeError"
        ),
        "algorithm.kl_estimator=nowhere_pkg:k9": "algorithm.kl_estimator: cannot import 'nowhere_pkg'",
        "balance.partitioner=nowhere_pkg:split": "balance.partitioner: cannot import 'nowhere_pkg'",
        "algorithm.advantage.kind=tests.plugins.my_verifier:even_digit": (
            "algorithm.advantage.kind 'tests.plugins.my_verifier:even_digit' has no `config` section class"
        ),
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_experiment(config, [override])
        assert message in str(err.value), (override, str(err.value))
    with pytest.raises(ConfigError, match="algorithm.advantage.plugin.scale: Input should be greater than 0"):
        load_experiment(
            config, ["algorithm.advantage.kind=tests.plugins.my_advantage:ESTIMATOR", "algorithm.advantage.scale=-1"]
        )


VANILLA_PG = """
from pydantic import Field
from yatt.algorithms.base import ComponentConfig, PolicyLoss


class VanillaConfig(ComponentConfig):
    weight: float = Field(1.0, description="Multiplies the loss.")


def vanilla(logprobs, old_logprobs, advantages, mask, cfg):
    loss = -cfg.weight * advantages.unsqueeze(-1) * logprobs * mask
    return loss, {"logprob_mean": (logprobs * mask).sum() / mask.sum()}


LOSS = PolicyLoss(config=VanillaConfig, compute=vanilla, stats=("logprob_mean",))
"""


def test_a_policy_loss_by_import_path_gets_its_section_and_its_stats_logged(tmp_path, monkeypatch):
    from yatt.algorithms.objective import Algorithm

    (tmp_path / "vanilla_pg.py").write_text(VANILLA_PG)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_experiment(
        experiment(tmp_path, ONE_TOKEN_GRPO),
        ["algorithm.policy_loss.kind=vanilla_pg:LOSS", "algorithm.policy_loss.weight=2"],
    )
    algorithm = Algorithm(cfg.algorithm)
    assert cfg.algorithm.policy_loss.weight == 2.0 and algorithm.stats == ("policy_loss", "logprob_mean")
    logprobs, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 1.0]])
    loss, stats = algorithm.loss.compute(logprobs, logprobs, torch.tensor([0.5]), mask, cfg.algorithm.policy_loss)
    torch.testing.assert_close(loss, torch.tensor([[1.0, 2.0]]))  # -2 * .5 * logprob
    assert float(stats["logprob_mean"]) == -1.5
