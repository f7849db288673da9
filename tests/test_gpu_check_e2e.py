"""The whole-loop GPU checks run everywhere: on CPU their two GPU-only checks are skipped and the rest (finite
loss, moving weights, engine/trainer log-prob agreement with the hf engine) must pass, so the scripts are known
to work before a GPU is lent. gpu_check_e2e.py trains with the torch backend in bfloat16, gpu_check_megatron.py
with the megatron backend (on CPU in float32)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, env, experiment, genrm_reward
from megatron_ranks import needs_megatron

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine


def passing_report(tmp_path: Path, script: str, *args: str, body: str = "") -> dict:
    """Run scripts/<script>.py for 3 steps on the tiny one-token GRPO experiment; its report, checked."""
    config = experiment(tmp_path, ONE_TOKEN_GRPO + body)
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / f"scripts/{script}.py"),
            "--config",
            str(config),
            "--steps",
            "3",
            "--out",
            str(tmp_path),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / f"{script}.json").read_text())
    assert report["ok"] and report["checks"]["logprobs_agree"] and report["checks"]["weights_moved"], report
    assert len(report["policy_loss"]) == 3
    if not torch.cuda.is_available():
        assert report["skipped"] == ["offload_frees_memory", "nccl_group"], report
    return report


@pytest.mark.slow  # the ahead check below runs the same script with more on
def test_gpu_check_e2e_passes(tmp_path):
    report = passing_report(tmp_path, "gpu_check_e2e")
    assert (report["trainer_backend"], report["dtype"]) == ("torch", "bfloat16")


@pytest.mark.slow  # the composed check below runs the same script with more on
@needs_megatron
def test_gpu_check_megatron_passes(tmp_path):
    report = passing_report(tmp_path, "gpu_check_megatron")
    assert report["trainer_backend"] == "megatron"
    if not torch.cuda.is_available():  # float32: the engine samples from exactly the trainer's weights
        assert report["dtype"] == "float32" and report["logprob_diff_mean_max"] < 1e-3, report


@needs_megatron
def test_gpu_check_megatron_composed_passes(tmp_path):
    """The composed configuration: a GenRM judge configured for vLLM (switched to an hf engine by the script),
    balancing and export_hf; every step judged, the exported policy loads."""
    judged = genrm_reward(tmp_path, "{vllm: {kv_cache_gib: 0.5}}")
    report = passing_report(tmp_path, "gpu_check_megatron", "--composed", body=judged)
    assert report["trainer_backend"] == "megatron" and report["checks"]["judged"], report
    assert report["checks"]["export_loads"] and report["export"].startswith("checkpoints/step-"), report


def test_gpu_check_e2e_ahead_of_the_trainer_passes(tmp_path):
    """--schedule one_step_off: the engine generates the next batch while the trainer trains (on the GPU machine
    the one GPU is shared, asked for with rollout.engine.gpus); the trained samples are one version stale."""
    report = passing_report(tmp_path, "gpu_check_e2e", "--schedule", "one_step_off")
    assert report["checks"]["ran_ahead"] and "offload_frees_memory" in report["skipped"], report
    assert "rollout.schedule.mode=one_step_off" in report["command"], report
