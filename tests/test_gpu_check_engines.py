"""The GPU check script for engines runs everywhere: on CPU its memory checks are skipped and the rest
(weight pushes, a sleep/wake cycle, owner switches between two engines) must still pass, so the script
is known to work before a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e import env

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine


@pytest.mark.slow  # CI: engine sleep/wake and weight loads run in tests/test_vllm_engine.py and test_vl_engines.py
def test_gpu_check_engines_passes(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu_check_engines.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert report["ok"] and len(report["checks"]) >= 6, report
    if not torch.cuda.is_available():
        assert report["memory_checks"].startswith("skipped"), report
