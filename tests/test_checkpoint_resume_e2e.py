"""Exact resume through the launcher (torchrun, 2 ranks, vLLM engines): a run stopped by SIGTERM, resumed,
killed with kill -9 in the middle of a background checkpoint write, and resumed again, logs the same
per-step metrics and ends with the same weights as an uninterrupted run."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, env, experiment, process_tree, torchrun_args
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine
STEPS = 6
# wall-clock measurements (per-device role times, engine busy time), the only fields allowed to differ
# (and sync/, what the weight syncs sent the engines: a resumed run first pushes the policy to its new engines)
TIMING = ("time/", "perf/", "placement/", "device", "load/", "genrm/judged_per_busy_s", "sync/")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    config = experiment(
        tmp,
        f"""
{ONE_TOKEN_GRPO}checkpoint: {{every: 2, keep: 2}}
run: {{name: r, steps: {STEPS}, eval_every: 3}}
""",
        name="resume.yaml",
    )
    return tmp, config


def launch(tmp: Path, config: Path, out: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_args(config, f"run.output_dir={tmp / out}", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        cwd=tmp,
    )


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    return out


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(proc: subprocess.Popen, condition, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the run ended or stalled before the expected moment:\n" + finish(proc)[-3000:])
        time.sleep(0.02)


def kill_while_saving(proc: subprocess.Popen, ckpts: Path, committed: int = 2) -> Path:
    """kill -9 a launch's whole process tree once checkpoint `committed` is on disk and a later one is being
    written (its staging folder exists: launch with checkpoint.debug_write_delay_s); the committed checkpoint."""
    saved = ckpts / f"step-{committed:08d}"

    def writing() -> bool:
        return (saved / "manifest.json").is_file() and any(".tmp-" in p.name for p in ckpts.iterdir())

    wait_for(proc, lambda: ckpts.is_dir() and writing())
    for pid in process_tree(proc.pid):
        os.kill(pid, signal.SIGKILL)
    finish(proc)
    return saved


def comparable(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "elapsed_s" and not k.startswith(TIMING)} for r in records]


@pytest.fixture(scope="module")
def uninterrupted(setup):
    tmp, config = setup
    out = finish(launch(tmp, config, "full"))
    assert "done:" in out, out[-3000:]
    return tmp / "full" / "r"


@pytest.mark.slow  # CI: exact resume after kill -9 composed with LoRA, images, the critic, megatron (their tests)
def test_interrupted_and_resumed_run_matches_the_uninterrupted_one(setup, uninterrupted):
    tmp, config = setup
    run_dir = tmp / "chain" / "r"
    ckpts = run_dir / "checkpoints"

    # 1. SIGTERM (a preemption) after step 2: the ranks finish their step, save and exit cleanly. Slow writes
    #    make step 4 wait for step 2's checkpoint, so the signal surely lands before the last step.
    proc = launch(tmp, config, "chain", "checkpoint.debug_write_delay_s=0.5")
    wait_for(proc, lambda: max(logged_steps(run_dir), default=0) >= 2)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert "received SIGTERM at step" in out and "resume with --resume auto" in out, out[-3000:]
    stopped = int(out.split("received SIGTERM at step ")[1].split(":")[0])
    assert 2 <= stopped < STEPS and (ckpts / f"step-{stopped:08d}" / "manifest.json").is_file()
    assert 'launch/train.py", line' not in out, out[-3000:]  # no rank failed (torchrun itself reports the signal)

    # 2. resume, then kill -9 everything while the next checkpoint is being written in the background
    proc = launch(tmp, config, "chain", "--resume", "auto", "checkpoint.debug_write_delay_s=1.0")
    wait_for(proc, lambda: any(".tmp-" in p.name for p in ckpts.iterdir()))
    staging = [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]
    for pid in process_tree(proc.pid):
        os.kill(pid, signal.SIGKILL)
    out = finish(proc)
    assert f"resuming from {ckpts / f'step-{stopped:08d}'}" in out, out[-3000:]
    assert all((ckpts / name).exists() for name in staging), "the kill did not land during the write"

    # 3. the same command again (auto is the default): the partial checkpoint is skipped with a warning,
    #    the run completes
    out = finish(launch(tmp, config, "chain"))
    assert "warning: skipping partial checkpoint" in out and "done:" in out, out[-3000:]

    assert logged_steps(run_dir) == list(range(STEPS + 1))
    elapsed = [json.loads(line)["elapsed_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert elapsed == sorted(elapsed), elapsed  # the clock runs on across the three launches
    expected, got = comparable(uninterrupted), comparable(run_dir)
    for want, have in zip(expected, got):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    a = load_file(uninterrupted / "policy" / "model.safetensors")
    b = load_file(run_dir / "policy" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # needs the 6-step run; CI: check_compatible's test, relaunches in test_operator_e2e.py
def test_incompatible_config_is_refused_by_name(setup, uninterrupted):
    tmp, config = setup
    out = finish(launch(tmp, config, "full", "--resume", "auto", "trainer.lr=0.02"))
    assert "incompatible config" in out and "trainer.lr: checkpoint 0.01, now 0.02" in out, out[-3000:]
    assert "--resume none --overwrite to start this run over" in out, out[-3000:]


@pytest.mark.slow  # needs the 6-step run; CI: check_compatible's test, relaunches in test_operator_e2e.py
def test_rerunning_a_finished_run_reports_it_and_changes_nothing(setup, uninterrupted):
    tmp, config = setup
    before = {p: p.read_bytes() for p in (uninterrupted / "summary.json", uninterrupted / "metrics.jsonl")}
    out = finish(launch(tmp, config, "full"))
    assert f"already finished at step {STEPS}" in out and "--resume none" in out, out[-3000:]
    assert all(p.read_bytes() == data for p, data in before.items())
    assert (uninterrupted / "checkpoints" / f"step-{STEPS:08d}").is_dir()
