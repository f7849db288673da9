"""On-policy distillation end to end: a teacher served like a judge, here on the GenRM side of partial placement.

The refusals first (no ranks started): a teacher with another tokenizer, a distill advantage without a teacher, a
teacher nothing reads, a teacher too short for the samples; then a real 2-rank torchrun run, partial placement, hf
engines, a larger random teacher with the policy's tokenizer, the advantage the per-token teacher - student
log-ratio mixed with the rule reward."""

from __future__ import annotations

import json
import math

import pytest
from e2e import DIGITS, JUDGE_TINY, experiment, torchrun

from yatt.config import load_experiment
from yatt.config_loading import ConfigError
from yatt.models.tiny import write_tiny_model
from yatt.preflight import check_run

TEACHER = DIGITS.model_copy(update={"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3})
DISTILL = "algorithm: {{mini_batches: 2, advantage: {{kind: distill, reward_coef: 0.5}}}}\n"


def config(tmp, teacher, extra: str = "") -> str:
    return f"""rollout: {{group_size: 8, max_new_tokens: 2, engine: {{backend: hf}}}}
{DISTILL.format()}trainer: {{lr: 0.01, micro_batch_size: 16}}
reward:
  kind: rule
  teacher: {{model: {teacher}, engine: {{backend: hf}}}}
balance: {{enabled: true}}
run: {{output_dir: {tmp / "runs"}, steps: 2, eval_every: 0}}
{extra}"""


def test_a_teacher_is_refused_in_one_line_when_it_cannot_score_the_students_ids(tmp_path):
    other = write_tiny_model(tmp_path / "other", JUDGE_TINY, seed=5)  # another alphabet: another vocabulary
    path = experiment(tmp_path, config(tmp_path, other))
    with pytest.raises(ConfigError, match="has another tokenizer than model.path") as err:
        check_run(load_experiment(path, placement="partial"), 2, str(path))
    assert "\n" not in str(err.value)
    same = write_tiny_model(tmp_path / "teacher", TEACHER.model_copy(update={"max_position_embeddings": 8}), seed=5)
    path = experiment(tmp_path, config(tmp_path, same))
    with pytest.raises(ConfigError, match="reward.teacher scores prompt \\+ response \\(10 tokens\\)"):
        check_run(load_experiment(path), 2, str(path))
    with pytest.raises(ConfigError, match="does not read its log-probs"):
        load_experiment(path, ["algorithm.advantage={kind: grpo}"])
    plain = experiment(tmp_path, "algorithm: {advantage: {kind: distill}}\n", name="plain.yaml")
    with pytest.raises(ConfigError, match="reads a teacher's log-probs, but reward.teacher is not set"):
        load_experiment(plain)
    assert load_experiment(path, placement="partial").placement.mode == "partial"  # a teacher is enough for it


@pytest.mark.engine
@pytest.mark.slow  # CI: tests/test_composition_matrix.py distils under partial placement with balancing (fsdp2,
# torch with a tool loop) and on megatron TP=2 / PP=2
def test_distillation_with_partial_placement(tmp_path):
    teacher = write_tiny_model(tmp_path / "teacher", TEACHER, seed=5)
    path = experiment(tmp_path, config(tmp_path, teacher))
    proc = torchrun(path, "--placement", "partial", "run.name=distill", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs/distill/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-2:] == [1, 2]
    for r in records[-2:]:
        assert r["placement/rollout_devices"] == 1 and r["placement/genrm_devices"] == 1
        assert r["device1/owned_genrm_s"] > 0  # the teacher ran on the GenRM side of the split
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0.0
        assert math.isfinite(r["actor/policy_loss"]) and r["actor/grad_norm"] > 0
        assert r["teacher/rerouted"] == 0 and r["teacher/duplicates_dropped"] == 0
        assert r["load/genrm_busy_s"] > 0
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
