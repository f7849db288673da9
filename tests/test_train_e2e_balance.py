"""A short real run with dynamic sampling, DP rebalancing, token-budget micro-batches, 2 engines per rank and a
checkpoint every step; it also records every collective the ranks issue (checked as GPU-safe)."""

import json
import math

import pytest
from e2e import experiment, torchrun
from test_collectives import check_records, lockstep, read_records

from yatt.distributed import RECORD_ENV

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Random tiny policy: about half the groups are all wrong, so dynamic sampling has work to do."""
    tmp = tmp_path_factory.mktemp("e2e_balance")
    config = experiment(
        tmp,
        f"""
rollout: {{group_size: 8, max_new_tokens: 3, engines_per_rank: 2, engine: {{vllm: {{kv_cache_gib: 0.25}}}}}}
algorithm:
  mini_batches: 2
  dynamic_sampling: {{enabled: true, max_rounds: 3, initial_oversample: 1.5}}
trainer: {{lr: 0.01, micro_batch_tokens: 48}}
balance: {{enabled: true, attention_coef: 0.01}}
run: {{name: e2e_balance, output_dir: {tmp / "runs"}, steps: 3, eval_every: 0}}
checkpoint: {{every: 1}}
""",
    )
    proc = torchrun(config, "--placement", "full", cwd=tmp, extra_env={RECORD_ENV: str(tmp / "collectives")})
    return proc, tmp / "runs" / "e2e_balance"


def test_run_succeeds(run):
    proc, run_dir = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list((run_dir / "logs").glob("engine-rollout-1-rank1-*.log"))  # two engines per rank were started


def test_every_trained_group_has_reward_variance(run):
    _, run_dir = run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(records) == 3
    for r in records:
        assert r["dynamic_sampling/trained_zero_var_groups"] == 0, r
        assert r["reward/zero_variance_group_frac"] == 0, r
        assert r["dynamic_sampling/kept_groups"] + 0.0 == r["rollout/samples"] / 8
        assert r["dynamic_sampling/kept_groups"] == 8 or r["dynamic_sampling/short_steps"] >= 1
        assert 1.0 <= r["dynamic_sampling/oversample_ratio"] <= 4.0
        assert r["balance/imbalance_after"] <= r["balance/imbalance_before"]
        for key in ("actor/policy_loss", "actor/grad_norm", "reward/mean", "time/balance_s"):
            assert math.isfinite(r[key]), (key, r)
    assert sum(r["dynamic_sampling/dropped_groups"] for r in records) > 0  # the filter had something to drop
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_trained"] == sum(r["rollout/samples"] for r in records)


def test_every_collective_is_a_cpu_gloo_op_issued_in_lockstep(run):
    """What the run sent would pass on GPUs: CPU tensors only (gloo under cpu:gloo,cuda:nccl), ops gloo has,
    and the same collectives in the same order with the same shapes on both ranks (else a job hangs)."""
    proc, run_dir = run
    assert proc.returncode == 0
    folder = run_dir.parents[1] / "collectives"
    ranks = [read_records(folder, r) for r in range(2)]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    moved = sum(r["balance/moved_samples"] for r in records)
    for recorded in ranks:
        check_records(recorded)
        calls = {r["call"] for r in recorded}
        assert {"sum", "max", "all_gather", "broadcast_object", "barrier"} <= calls, calls
        assert ("exchange" in calls) == (moved > 0)
    assert lockstep(ranks[0]) == lockstep(ranks[1])
