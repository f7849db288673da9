"""GenRM through the launcher, 2 ranks, both placement modes: rollout engines, judge engines, streaming."""

import json
import math

import pytest
from e2e import experiment, torchrun

from yatt.models.tiny import TinyModelConfig, write_tiny_model

pytestmark = pytest.mark.engine
TINY = dict(
    alphabet="0123456789+=:?yesno",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random policy and a random judge. The random judge's verdicts are mostly unreadable, which
    exercises the fallback; genrm_with_rule keeps a learning signal through the rule part."""
    tmp = tmp_path_factory.mktemp("genrm")
    judge = write_tiny_model(tmp / "judge", TinyModelConfig(**TINY, max_position_embeddings=32), seed=4)
    config = experiment(
        tmp,
        f"""
rollout: {{group_size: 8, max_new_tokens: 2, engine: {{vllm: {{kv_cache_gib: 0.25}}}}}}
reward:
  kind: genrm_with_rule
  judges:
    - name: j
      model: {judge}
      template: "{{question}}{{reference}}:{{response}}?"
      max_tokens: 3
      unparseable_score: 0.5
      engine: {{vllm: {{kv_cache_gib: 0.25}}}}
trainer: {{lr: 0.01, micro_batch_size: 32}}
run: {{output_dir: {tmp / "runs"}, steps: 2, eval_every: 0}}
""",
        model=TinyModelConfig(**TINY),
        name="genrm.yaml",
    )
    return tmp, config


def launch(tmp, config, placement):
    proc = torchrun(config, "--placement", placement, f"run.name={placement}", cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (tmp / "runs" / placement / "metrics.jsonl").read_text().splitlines()]


def check_common(records):
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["genrm/judged"] == 64  # every sample judged exactly once (8 prompts x 8 samples)
        assert 0.0 <= r["genrm/unparseable_frac"] <= 1.0 and 0.0 <= r["genrm/j/agree_with_rule"] <= 1.0
        assert r["genrm/judged_per_busy_s"] > 0 and r["genrm/max_queue"] >= 1
        assert math.isfinite(r["actor/policy_loss"]) and r["rollout/trainer_logprob_diff_max"] < 1e-3
        for d in (0, 1):
            assert 0.0 <= r[f"device{d}/idle_frac"] <= 1.0
        assert r["genrm/j/rerouted"] == 0 and r["genrm/j/duplicates_dropped"] == 0


@pytest.mark.slow  # CI: full placement with a judge runs in tests/test_composition_matrix.py
def test_full_placement_runs_judges_after_rollout(setup):
    records = launch(*setup, "full")
    check_common(records)
    for r in records[1:]:
        assert r["placement/rollout_devices"] == 2 and r["placement/genrm_devices"] == 2
        assert r["placement/switches"] >= 3  # rollout -> genrm -> train -> rollout on each device
        for d in (0, 1):
            assert r[f"device{d}/owned_genrm_s"] > 0 and r[f"device{d}/owned_train_s"] > 0


@pytest.mark.slow  # CI: partial placement with a judge in tests/test_composition_matrix.py (placement/* metrics)
def test_partial_placement_splits_devices(setup):
    records = launch(*setup, "partial")
    check_common(records)
    for r in records[1:]:
        assert r["placement/rollout_devices"] == 1 and r["placement/genrm_devices"] == 1
        assert r["device0/owned_genrm_s"] == 0 and r["device1/owned_rollout_s"] >= 0
        assert r["device1/owned_genrm_s"] > 0 and r["load/rollout_busy_s"] > 0 and r["load/genrm_busy_s"] > 0
