"""The whole-loop GPU check runs everywhere: on CPU its two GPU-only checks are skipped and the rest (finite
loss, moving weights, engine/trainer log-prob agreement in bfloat16 with the hf engine) must pass, so the
script is known to work before a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, env, experiment

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine


def test_gpu_check_e2e_passes(tmp_path):
    config = experiment(tmp_path, ONE_TOKEN_GRPO)
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu_check_e2e.py"), "--config", str(config),
                           "--steps", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check_e2e.json").read_text())
    assert report["ok"] and report["checks"]["logprobs_agree"] and report["checks"]["weights_moved"], report
    assert len(report["policy_loss"]) == 3
    if not torch.cuda.is_available():
        assert report["skipped"] == ["offload_frees_memory", "nccl_group"], report
