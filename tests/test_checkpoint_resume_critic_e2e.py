"""Exact resume of PPO with a critic through the launcher (torchrun, 2 ranks, hf engines): a run stopped at step
2 and resumed from its checkpoint to step 4 logs the same metrics as an uninterrupted 4-step run and ends with
the same policy and critic (weights, AdamW state, lr schedule are in the checkpoint)."""

import json
from pathlib import Path

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, experiment, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.engine
# wall-clock measurements, the only fields allowed to differ
# (and sync/, what the weight syncs sent the engines: a resumed run first pushes the policy to its new engines)
TIMING = ("time/", "perf/", "placement/", "device", "load/", "genrm/judged_per_busy_s", "sync/")
PPO = (
    ONE_TOKEN_GRPO.replace(
        "algorithm: {mini_batches: 2}", "algorithm: {mini_batches: 2, advantage: {kind: gae, lam: 0.95}}"
    )
    + """
critic: {lr: 0.01, warmup_steps: 1}
checkpoint: {every: 2, keep: 2}
run: {name: r, steps: 4, eval_every: 2}
"""
)


def comparable(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "elapsed_s" and not k.startswith(TIMING)} for r in records]


def critic_state(run_dir: Path) -> dict[str, torch.Tensor]:
    shared = load_file(str(run_dir / "checkpoints" / "step-00000004" / "shared.safetensors"))
    return {k: v for k, v in shared.items() if k.startswith("critic/")}


@pytest.mark.slow  # ~55 s; CI: the critic's checkpoint round trip in tests/test_shard_step_critic.py, PPO runs in the
# composition matrix, and an exact resume after kill -9 in the matrix's main combination
def test_a_resumed_ppo_run_matches_the_uninterrupted_one(tmp_path):
    config = experiment(tmp_path, PPO)

    def run(out: str, *args: str) -> str:
        done = torchrun(
            config,
            f"run.output_dir={tmp_path / out}",
            "rollout.engine.backend=hf",
            "rollout.engine.vllm=null",
            *args,
            cwd=tmp_path,
        )
        assert done.returncode == 0 and "done:" in done.stdout, (done.stdout + done.stderr)[-3000:]
        return done.stdout

    run("full")
    run("chain", "run.steps=2")
    out = run("chain")  # the same run extended: resumes from step 2's checkpoint
    assert "resuming from" in out and "(step 2)" in out, out[-3000:]

    full, chain = tmp_path / "full" / "r", tmp_path / "chain" / "r"
    expected, got = comparable(full), comparable(chain)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4] and "critic/value_loss" in got[-1]
    assert expected[1]["critic/warmup"] == 1.0 and expected[3]["critic/warmup"] == 0.0
    for want, have in zip(expected, got):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    a, b = critic_state(full), critic_state(chain)
    assert any("/model/score." in k for k in a) and any("/optimizer/" in k for k in a)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    a, b = load_file(full / "policy" / "model.safetensors"), load_file(chain / "policy" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
