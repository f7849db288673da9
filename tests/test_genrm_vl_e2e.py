"""GenRM judges of image prompts through the launcher: 2 ranks, partial placement (one device rolls out the tiny VL
policy while the other judges), real hf engines. A VL judge (sees the images) and a text-only judge (reads the
text); both random, so most verdicts are unreadable and genrm_with_rule keeps a learning signal. The VL judge
also with the policy on the megatron backend at TP=2 with balancing: the composed configuration with images."""

import json
import math

import pytest
from e2e import torchrun

from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.models.tiny_vl import write_tiny_vl_model
from yatt.quickstart.shapes import write_shapes_files

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("genrm_vl")
    write_shapes_files(tmp / "data", sizes={"train": 32, "eval": 8})
    return tmp, {
        "policy": write_tiny_vl_model(tmp / "policy", seed=1),
        "vl": write_tiny_vl_model(tmp / "vl_judge", seed=2),
        "text": write_tiny_model(tmp / "text_judge", TinyModelConfig(), seed=3),
    }


def run(tmp, folders, judge: str, template: str, name: str | None = None, trainer: str = ""):
    name = name or judge
    config = tmp / f"{name}.yaml"
    config.write_text(f"""
model: {{path: {folders["policy"]}}}
data:
  train: {{kind: jsonl, files: [{tmp / "data" / "train.jsonl"}]}}
  eval: {{kind: jsonl, files: [{tmp / "data" / "eval.jsonl"}]}}
  prompts_per_step: 8
  eval_prompts: 8
  max_prompt_tokens: 32
rollout: {{group_size: 4, max_new_tokens: 2, engine: {{backend: hf}}}}
reward:
  kind: genrm_with_rule
  judges:
    - {{name: j, model: {folders[judge]}, template: "{template}", max_tokens: 3, unparseable_score: 0.5,
        engine: {{backend: hf}}}}
trainer: {{{trainer}lr: 0.01, micro_batch_size: 32}}
balance: {{enabled: true}}
run: {{name: {name}, output_dir: {tmp / "runs"}, steps: 2, eval_every: 2}}
""")
    proc = torchrun(config, "--placement", "partial", cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["genrm/judged"] == 32  # every sample judged once (8 prompts x 4 samples)
        assert 0.0 <= r["genrm/unparseable_frac"] <= 1.0 and 0.0 <= r["genrm/j/agree_with_rule"] <= 1.0
        assert r["placement/rollout_devices"] == 1 and r["placement/genrm_devices"] == 1
        for key in ("actor/policy_loss", "actor/grad_norm", "reward/mean", "genrm/judged_per_busy_s"):
            assert math.isfinite(r[key]), (key, r)
        assert r["rollout/trainer_logprob_diff_max"] < 1e-3
    assert math.isfinite(records[-1]["eval/accuracy"])


def test_vl_judge_under_partial_placement(setup):
    run(*setup, "vl", "{images}{question}:{response}?")


@pytest.mark.slow  # ~1 min; CI runs the VL judge with the torch policy, and a megatron VL run elsewhere
def test_vl_judge_under_partial_placement_with_a_megatron_tp2_policy(setup):
    run(
        *setup,
        "vl",
        "{images}{question}:{response}?",
        "megatron",
        "backend: megatron, megatron: {tensor_parallel: 2}, ",
    )


@pytest.mark.slow  # CI: the VL judge run above; tests/test_genrm_images.py checks a text judge of image prompts
def test_text_judge_of_image_prompts_under_partial_placement(setup):
    run(*setup, "text", "{question}:{response}?")
