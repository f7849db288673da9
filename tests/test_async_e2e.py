"""Rollouts ahead of the trainer (rollout.schedule), end to end: 2 torchrun ranks, real engines, dynamic sampling.

- async with max_staleness 0 is the sync run exactly (same metrics, same final weights);
- one_step_off trains step s on rollouts of step s - 2's weights (staleness 1 from step 2 on), and a run killed
  with kill -9 while a checkpoint is being written resumes to the uninterrupted run's metrics and weights.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from e2e import JUDGE_TINY, ONE_TOKEN_GRPO, experiment, genrm_reward
from safetensors.torch import load_file
from test_checkpoint_resume_e2e import finish, kill_while_saving, launch

pytestmark = pytest.mark.engine
STEPS = 6
# wall-clock measurements and the schedule's own (sync logs none), the only fields allowed to differ
# sync/: what the weight syncs sent the engines, which a resume (its own push) and a schedule (when pushes load) move
TIMING = ("time/", "perf/", "placement/", "device", "load/", "genrm/judged_per_busy_s", "async/", "sync/")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return tmp, experiment(
        tmp,
        f"""
{ONE_TOKEN_GRPO}algorithm: {{mini_batches: 2, dynamic_sampling: {{enabled: true, max_rounds: 2}}}}
checkpoint: {{every: 2, keep: 2}}
run: {{name: r, steps: {STEPS}, eval_every: 3}}
""",
        name="async.yaml",
    )


def run(tmp: Path, out: str, config: Path, *args: str) -> Path:
    text = finish(launch(tmp, config, out, *args))
    assert "done:" in text, text[-3000:]
    return tmp / out / "r"


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path) -> None:
    drop = lambda r: {k: v for k, v in r.items() if k != "elapsed_s" and not k.startswith(TIMING)}
    for want, have in zip(map(drop, records(a)), map(drop, records(b)), strict=True):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    wa, wb = load_file(a / "policy" / "model.safetensors"), load_file(b / "policy" / "model.safetensors")
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # k=0 is the sync run: the one_step_off test's exact resume covers the schedule in CI
def test_async_with_max_staleness_0_is_the_sync_run(config):
    tmp, path = config
    sync = run(tmp, "sync", path)
    ahead = run(tmp, "async0", path, "rollout.schedule.mode=async", "rollout.schedule.max_staleness=0")
    assert_same_run(sync, ahead)
    steps = [r for r in records(ahead) if r["step"] > 0]
    assert all(r["async/staleness_mean"] == 0 and r["async/staleness_max"] == 0 for r in steps)


@pytest.mark.slow  # CI: an ahead schedule's exact resume after kill -9 is tests/test_resume_e2e_vl.py's (torch)
def test_one_step_off_is_one_step_stale_and_resumes_exactly_after_kill_9(config):
    tmp, path = config
    mode = "rollout.schedule.mode=one_step_off"
    uninterrupted = run(tmp, "full", path, mode)
    steps = [r for r in records(uninterrupted) if r["step"] > 0]
    # step 1 trains on the first batch (the starting weights); from step 2 on, on step s - 2's weights
    assert [r["async/staleness_max"] for r in steps] == [0.0] + [1.0] * (STEPS - 1)
    assert all(r["async/staleness_mean"] == 1.0 for r in steps[1:])

    run_dir, ckpts = tmp / "chain" / "r", tmp / "chain" / "r" / "checkpoints"
    # step 2's checkpoint committed, step 4's being written
    saved = kill_while_saving(launch(tmp, path, "chain", mode, "checkpoint.debug_write_delay_s=1.0"), ckpts)
    # the checkpoint holds the batches made ahead with the weights before step 2's (those of steps 3 and 4)
    ahead = json.loads((saved / "rank0.json").read_text())["rollouts"]
    assert ahead["version"] == 2 and sorted(ahead["ready"]) == ["3", "4"]
    out = finish(launch(tmp, path, "chain", mode))
    assert f"resuming from {saved}" in out and "done:" in out, out[-3000:]
    assert_same_run(uninterrupted, run_dir)


def test_partial_rollouts_resume_on_the_new_weights(tmp_path):
    """in_flight: resume on real vLLM engines: a push interrupts the batch being generated, which then resumes
    on the new weights; every token keeps its version, the bound holds on the version a batch starts with,
    and a resumed run trains on the checkpointed batches with their per-token versions."""
    path = experiment(
        tmp_path,
        f"""rollout:
  group_size: 8
  max_new_tokens: 48     # generation outlasts the tiny trainer's step: pushes land mid-batch
  engine: {{vllm: {{kv_cache_gib: 0.25}}}}
  schedule: {{mode: async, max_staleness: 1, in_flight: resume}}
algorithm: {{mini_batches: 2}}
trainer: {{lr: 0.01, micro_batch_size: 16}}
checkpoint: {{every: 2, keep: 2}}
run: {{name: r, steps: {STEPS}, eval_every: {STEPS}}}
""",
    )
    run_dir, ckpts = tmp_path / "resume" / "r", tmp_path / "resume" / "r" / "checkpoints"
    saved = kill_while_saving(launch(tmp_path, path, "resume", "checkpoint.debug_write_delay_s=1.0"), ckpts)
    for batch in json.loads((saved / "rank0.json").read_text())["rollouts"]["ready"].values():
        for r in batch["rollouts"]:
            versions = r["token_versions"]
            assert len(versions) == len(r["response_ids"]) and versions == sorted(versions) and versions[0] >= 0
    out = finish(launch(tmp_path, path, "resume"))
    assert f"resuming from {saved}" in out and "done:" in out, out[-3000:]
    steps = {r["step"]: r for r in records(run_dir) if r["step"] > 0}  # the steps after 2 were logged again
    assert sorted(steps) == list(range(1, STEPS + 1))
    for r in steps.values():
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["async/staleness_max"] <= 1
    resumed = [r["async/resumed_samples"] for r in steps.values()]
    assert sum(resumed) > 0, resumed


@pytest.mark.slow  # CI: tests/test_composition_matrix.py runs partial placement + GenRM with one_step_off
def test_partial_placement_with_genrm_ahead_of_the_trainer(tmp_path):
    """placement.mode=partial with a GenRM judge and rollouts made ahead: the producers of both ranks share each
    other's engines (rank 0 rolls out, rank 1 judges, streamed), over a process group of their own. async with
    max_staleness 0 is the sync run exactly, and one_step_off trains on rollouts one version old."""
    path = experiment(
        tmp_path,
        f"""
rollout: {{group_size: 8, max_new_tokens: 2, engine: {{backend: hf}}}}
{genrm_reward(tmp_path, "{backend: hf}")}trainer: {{lr: 0.01, micro_batch_size: 32}}
algorithm: {{mini_batches: 2}}
run: {{name: r, steps: 4, eval_every: 2}}
""",
        model=JUDGE_TINY,
        name="partial.yaml",
    )
    sync = run(tmp_path, "sync", path, "--placement", "partial")
    ahead = run(
        tmp_path,
        "k0",
        path,
        "--placement",
        "partial",
        "rollout.schedule.mode=async",
        "rollout.schedule.max_staleness=0",
    )
    assert_same_run(sync, ahead)
    stale = run(tmp_path, "osf", path, "--placement", "partial", "rollout.schedule.mode=one_step_off")
    steps = [r for r in records(stale) if r["step"] > 0]
    assert [r["async/staleness_max"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["genrm/judged"] > 0 for r in steps)


@pytest.mark.slow  # ~3 min; CI: partial rollouts (full placement) and partial placement ahead
def test_partial_placement_with_partial_rollouts(tmp_path):
    """in_flight: resume with placement.mode=partial: both ranks' producers roll out on rank 0's engine while
    rank 1's judges them, and a push interrupts them mid-batch. The ranks push together once every producer has
    let go of the engines (rank 1, judging, only keeps the weights for its sleeping rollout engine); the
    interrupted samples resume on the new weights, every token keeps its version and every sample is judged."""
    path = experiment(
        tmp_path,
        f"""rollout:
  group_size: 8
  max_new_tokens: 24
  engine: {{backend: tests.plugins.slow:SlowEngine}}
  schedule: {{mode: async, max_staleness: 1, in_flight: resume}}
{genrm_reward(tmp_path, "{backend: hf}", positions=64)}trainer:
  backend: tests.plugins.slow:SlowTrainer  # with the engine's waits: pushes land part-way through samples
  lr: 0.01
  micro_batch_size: 32
algorithm: {{mini_batches: 2}}
run: {{name: r, steps: {STEPS}, eval_every: 3}}
""",
        model=JUDGE_TINY,
        name="partial_resume.yaml",
    )
    steps = [r for r in records(run(tmp_path, "pr", path, "--placement", "partial")) if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["async/staleness_max"] <= 1 and r["genrm/judged"] == r["rollout/samples"] > 0
    assert sum(r["async/resumed_samples"] for r in steps) > 0, [r["async/resumed_samples"] for r in steps]
