"""Image prompts through the launcher: torchrun, 2 ranks, real engines, the tiny VL policy trained by the torch
backend's DDP, or by the megatron backend at TP=2 (its checkpoints exporting Hugging Face VL folders)."""

import json
import math

import pytest
import torch
from e2e import torchrun
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from yatt.models.vision import vision_parameter
from yatt.quickstart.sft_vl import run_sft_vl
from yatt.quickstart.shapes import write_shapes_files

pytestmark = pytest.mark.engine


@pytest.fixture(
    scope="module",
    # CI runs vllm; images moved by balancing: tests/test_balance_exchange_images.py; the megatron VL step equal to
    # the torch backend's: tests/test_megatron_vl.py
    # slow, all: CI runs image prompts end to end in tests/test_resume_e2e_vl.py (hf engines, dynamic sampling, an
    # ahead schedule, exact resume) and test_a_step_trains_text_and_image_prompts_in_one_batch below; a vLLM engine
    # agrees with the trainer on image prompts in tests/test_vl_engines.py
    params=[pytest.param(p, marks=pytest.mark.slow) for p in ("vllm", "hf", "hf-balanced", "hf-megatron")],
)
def run(request, tmp_path_factory):
    backend, balanced = request.param.split("-")[0], request.param.endswith("balanced")
    megatron = request.param.endswith("megatron")
    trainer = "backend: megatron, megatron: {tensor_parallel: 2}, " if megatron else ""
    tmp = tmp_path_factory.mktemp(f"vl_{request.param}")
    # a short warm-up: the answer format and the majority answer, so sampled groups have reward variance
    write_shapes_files(tmp / "data", sizes={"sft": 256, "train": 32, "eval": 8})
    policy = tmp / "policy0"
    run_sft_vl(tmp / "data", policy, stop_at=1.01, batch_size=32, max_steps=120, eval_every=120, log=lambda _: None)
    vllm = ", vllm: {kv_cache_gib: 0.25}" if backend == "vllm" else ""  # the vLLM backend's own section
    config = tmp / "exp.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data:
  train: {{kind: jsonl, files: [{tmp / "data" / "train.jsonl"}]}}
  eval: {{kind: jsonl, files: [{tmp / "data" / "eval.jsonl"}]}}
  prompts_per_step: 8
  eval_prompts: 8
  max_prompt_tokens: 32
rollout: {{group_size: 4, max_new_tokens: 2, engine: {{backend: {backend}{vllm}}}}}
balance: {{enabled: {str(balanced).lower()}}}
algorithm: {{mini_batches: 2}}
trainer: {{{trainer}lr: 0.01, micro_batch_size: 16}}
checkpoint: {{every: 2, export_hf: {str(megatron).lower()}}}
run: {{name: e2e, output_dir: {tmp / "runs"}, steps: 2, eval_every: 2}}
""")
    return torchrun(config, "--placement", "full", cwd=tmp), tmp / "runs" / "e2e", policy, megatron


def test_image_run_trains_and_engines_follow(run):
    proc, run_dir, policy, megatron = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert any(r["reward/zero_variance_group_frac"] < 1 for r in records[1:]), "no step had a learning signal"
    for r in records[1:]:
        for key in ("actor/policy_loss", "actor/grad_norm", "reward/mean"):
            assert math.isfinite(r[key]), (key, r)
        assert r["rollout/samples"] == 32
        # step 2's rollouts come from engines updated after step 1: their log-probs are the trainer's
        assert r["rollout/trainer_logprob_diff_max"] < 1e-3, r
    before, after = load_file(policy / "model.safetensors"), load_file(run_dir / "policy" / "model.safetensors")
    assert set(before) == set(after)
    vision = [k for k in before if vision_parameter(k)]
    assert vision and max((before[k] - after[k]).abs().max().item() for k in vision) > 1e-4  # the tower trained
    assert (run_dir / "policy" / "processor_config.json").is_file()  # exported as a VL folder
    export = run_dir / "checkpoints" / "step-00000002" / "policy"
    assert export.is_dir() == megatron
    if megatron:  # checkpoint.export_hf: the shards gathered into the same VL folder
        assert load_file(export / "model.safetensors").keys() == after.keys()
        assert all(torch.equal(load_file(export / "model.safetensors")[k], after[k]) for k in after)
        assert AutoModelForImageTextToText.from_pretrained(export) is not None
    moved = sum(r.get("balance/moved_samples", 0) for r in records[1:])
    assert sum(r.get("balance/moved_pixel_bytes", 0) for r in records[1:]) == moved * 4 * (3 * 32 * 32 + 32 * 32)


@pytest.mark.slow  # CI: tests/test_vl_engines.py trains text and image rows in one batch, the hf engine agreeing
# with the trainer on image prompts; tests/test_balance_exchange_images.py moves images between ranks
def test_a_step_trains_text_and_image_prompts_in_one_batch(tmp_path):
    """Mixed rows: the data holds image prompts and text prompts, so each step's batch (and micro-batch) mixes
    them, balanced across the ranks; the engines' log-probs of both kinds agree with the trainer's on the mixed
    batches."""
    write_shapes_files(tmp_path / "data", sizes={"sft": 256, "train": 24, "eval": 8})
    policy = tmp_path / "policy0"
    run_sft_vl(tmp_path / "data", policy, stop_at=1.01, batch_size=32, max_steps=60, eval_every=60, log=lambda _: None)
    train = tmp_path / "data" / "train.jsonl"
    lines = train.read_text().splitlines()
    text = [json.dumps({"prompt": f"how many {c}?", "answer": "0", "data_source": "exact_match"}) for c in "rgb" * 4]
    # two image rows, then two text rows, and so on: each rank's shard (every other row) mixes both kinds
    mixed = [line for i in range(0, 12, 2) for line in (*lines[i : i + 2], *text[i : i + 2])]
    train.write_text("\n".join(mixed) + "\n")
    config = tmp_path / "exp.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data:
  train: {{kind: jsonl, files: [{train}]}}
  shuffle: false
  eval: {{kind: jsonl, files: [{tmp_path / "data" / "eval.jsonl"}]}}
  prompts_per_step: 8
  eval_prompts: 8
  max_prompt_tokens: 32
rollout: {{group_size: 4, max_new_tokens: 2, engine: {{backend: hf}}}}
balance: {{enabled: true}}
algorithm: {{mini_batches: 1}}
trainer: {{lr: 0.01, micro_batch_size: 32}}
run: {{name: mixed, output_dir: {tmp_path / "runs"}, steps: 2, eval_every: 2}}
""")
    proc = torchrun(config, "--placement", "full", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "mixed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert math.isfinite(r["actor/policy_loss"]) and r["rollout/samples"] == 32
        assert math.isfinite(r["balance/imbalance_after"])
        assert r["rollout/trainer_logprob_diff_max"] < 1e-3, r
    assert sum(r["balance/moved_samples"] for r in records[1:]) > 0, "no mixed step was rebalanced"
