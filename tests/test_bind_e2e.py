"""Engines bound to every interface and reached over a non-loopback address: 2 ranks under partial placement
(each rank's controller talks to the other rank's engines) in a network namespace of the test's own, where
10.77.0.1 is the node's address and torchrun's MASTER_ADDR. Needs root and `unshare` (CI has both)."""

import json
import os
import shlex
import shutil
import subprocess

import pytest
from e2e import JUDGE_TINY, env, experiment, genrm_reward, torchrun_args

pytestmark = pytest.mark.engine
ADDRESS = "10.77.0.1"


def namespace_available() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not namespace_available(), reason="needs root, unshare and ip for a private network namespace")
@pytest.mark.slow  # CI: tests/test_multinode_e2e.py's partial placement across two nodes reaches the engines of the
# other node over its non-loopback address, bound to every interface
def test_partial_placement_over_a_non_loopback_address(tmp_path):
    config = experiment(
        tmp_path,
        f"""
rollout: {{group_size: 8, max_new_tokens: 2, engine: {{backend: hf, bind: 0.0.0.0}}}}
{genrm_reward(tmp_path, "{backend: hf, bind: 0.0.0.0}")}trainer: {{lr: 0.01, micro_batch_size: 32}}
run: {{name: bind, output_dir: {tmp_path / "runs"}, steps: 1, eval_every: 0}}
""",
        model=JUDGE_TINY,
        name="bind.yaml",
    )
    args = torchrun_args(config, "--placement", "partial")
    args[3:3] = ["--master_addr", ADDRESS, "--master_port", "29531"]  # after "-m torch.distributed.run"
    script = f"ip link set lo up && ip addr add {ADDRESS}/24 dev lo && exec {shlex.join(args)}"
    proc = subprocess.run(
        ["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "bind"
    served = [
        line
        for log in sorted((run_dir / "logs").glob("engine-*.log"))
        for line in log.read_text().splitlines()
        if "serving on" in line
    ]
    assert len(served) == 4, served  # a rollout engine and a judge engine per rank
    assert all(f"serving on tcp://{ADDRESS}:" in line for line in served), served
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    # rank 1's prompts were rolled out on rank 0's engine, rank 0's samples judged on rank 1's
    assert step["placement/rollout_devices"] == 1 and step["placement/genrm_devices"] == 1
    assert step["genrm/judged"] == 64 and step["load/rollout_busy_s"] > 0 and step["load/genrm_busy_s"] > 0
