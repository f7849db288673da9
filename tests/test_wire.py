"""Junk on the engine wire costs the engine little (generous bounds; benchmarks/wire.py measures precisely)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_keyless_junk_costs_the_engine_little_and_honest_calls_go_through(tmp_path):
    out = tmp_path / "wire.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "wire.py"),
            "--junk-mb",
            "24",
            "--attackers",
            "2",
            "--calls",
            "5",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert result["junk_mb"] >= 24
    # Before the CURVE handshake, these 24 MB cost the engine ~63 s of CPU and 2.1 GB.
    assert result["junk_engine_cpu_s"] < 5.0
    assert result["rpc_stats"]["refused_handshakes"] >= 2 and result["rpc_stats"]["rejected"] == 0
    assert result["honest_latency_ratio"] < 10.0
