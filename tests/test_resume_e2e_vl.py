"""Image prompts resume exactly after kill -9: 2 ranks, real hf engines, the tiny VL policy, dynamic sampling
(its queue carries groups over steps) and one_step_off (a checkpoint holds the batches made ahead). A
checkpoint stores rows, not pixels; resuming reads and encodes the images again (controllers.images
.reload_images), so the resumed run's metrics and weights equal the uninterrupted run's; with the torch backend
and with the megatron backend at TP=2 (its checkpoint holds each rank's shard, the vision tower included)."""

import json

import pytest
from test_async_e2e import assert_same_run, records
from test_checkpoint_resume_e2e import finish, kill_while_saving, launch

from yatt.quickstart.sft_vl import run_sft_vl
from yatt.quickstart.shapes import write_shapes_files

pytestmark = pytest.mark.engine
STEPS = 6


# megatron: slow (~2 min); CI runs the torch variant, and tests/test_train_e2e_vl.py a megatron VL run
@pytest.mark.parametrize("trainer", ["torch", pytest.param("megatron", marks=pytest.mark.slow)])
def test_image_prompts_with_dynamic_sampling_ahead_resume_exactly_after_kill_9(tmp_path, trainer):
    backend = "backend: megatron, megatron: {tensor_parallel: 2}, " if trainer == "megatron" else ""
    write_shapes_files(tmp_path / "data", sizes={"sft": 256, "train": 48, "eval": 8})
    policy = tmp_path / "policy0"
    run_sft_vl(tmp_path / "data", policy, stop_at=1.01, batch_size=32, max_steps=60, eval_every=60, log=lambda _: None)
    config = tmp_path / "exp.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data:
  train: {{kind: jsonl, files: [{tmp_path / "data" / "train.jsonl"}]}}
  eval: {{kind: jsonl, files: [{tmp_path / "data" / "eval.jsonl"}]}}
  prompts_per_step: 8
  eval_prompts: 8
  max_prompt_tokens: 32
rollout: {{group_size: 4, max_new_tokens: 2, engine: {{backend: hf}}, schedule: {{mode: one_step_off}}}}
algorithm: {{mini_batches: 2, dynamic_sampling: {{enabled: true, max_rounds: 2, initial_oversample: 1.5}}}}
trainer: {{{backend}lr: 0.01, micro_batch_size: 16}}
checkpoint: {{every: 2, keep: 2}}
run: {{name: r, steps: {STEPS}, eval_every: 3}}
""")
    uninterrupted = tmp_path / "full" / "r"
    assert "done:" in finish(launch(tmp_path, config, "full")), uninterrupted
    run_dir, ckpts = tmp_path / "chain" / "r", tmp_path / "chain" / "r" / "checkpoints"
    # step 2's checkpoint committed, step 4's being written
    saved = kill_while_saving(launch(tmp_path, config, "chain", "checkpoint.debug_write_delay_s=1.0"), ckpts)
    state = json.loads((saved / "rank0.json").read_text())
    held = [r for b in state["rollouts"]["ready"].values() for r in b["rollouts"]]
    assert held and all(r["row"]["images"] and r["vision"] is None for r in held)  # rows, not pixels
    out = finish(launch(tmp_path, config, "chain"))
    assert f"resuming from {saved}" in out and "done:" in out, out[-3000:]
    assert_same_run(uninterrupted, run_dir)
    assert any(r.get("rollout/samples") for r in records(run_dir))
