"""benchmarks/trainers.py at a tiny size (0.4M parameters, 2 ranks, torch vs megatron TP=2 vs torch FSDP2): its
state accounting counts what each rank holds (the torch backend: 4 bytes of weights, 4 of gradients and 8 of AdamW
moments per parameter; TP=2 and FSDP2 about half of that per rank), and the backends compute the same steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e import env
from megatron_ranks import needs_megatron

REPO = Path(__file__).resolve().parents[1]
pytestmark = [needs_megatron, pytest.mark.slow]  # a benchmark at its smallest settings (~25 s)


def test_tp2_holds_half_the_state_of_the_torch_backend(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/trainers.py"),
        "--hidden",
        "128",
        "--layers",
        "2",
        "--intermediate",
        "256",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "1024",
        "--samples",
        "4",
        "--steps",
        "1",
        "--variants",
        "torch",
        "megatron TP=2",
        "torch FSDP2",
        "--out",
        str(tmp_path / "trainers"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "trainers.json").read_text())
    torch_row, tp_row, fsdp2_row = report["variants"]
    params = report["params"]
    for rank in torch_row["state_bytes_per_rank"]:  # float32, every rank the whole model
        assert rank["params"] == rank["grads"] == 4 * params, rank
        assert 8 * params <= rank["optimizer"] <= 8 * params + 64 * 8, rank  # + AdamW's step counters
    # the shard: half of every split weight, the norms whole, a vocabulary of 1024 = 2 x 512 rows
    assert 0.45 <= report["tp2_state_ratio"] <= 0.6, report["tp2_state_ratio"]
    assert abs(tp_row["grad_norm_first"] - torch_row["grad_norm_first"]) <= 1e-5 * torch_row["grad_norm_first"]
    assert tp_row["logprob_diff_max"] < 1e-5, tp_row
    assert "TP=2 / torch per-rank state" in proc.stdout
    # FSDP2: half of every weight, gradient and moment (dim 0 split in two), and the same steps as DDP
    assert 0.45 <= report["fsdp2_state_ratio"] <= 0.55, report["fsdp2_state_ratio"]
    assert fsdp2_row["curve_rel_diff_max"] < 1e-5 and fsdp2_row["logprob_diff_max"] < 1e-5, fsdp2_row
