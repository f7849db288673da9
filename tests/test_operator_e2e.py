"""An operator's relaunches through launch/train.py --nproc 2 (real ranks and hf engines, a tiny policy, 2 steps):
a relaunch that fails on its inputs changes nothing in the run directory, a data error is reported as itself
whatever the resume mode, --resume none over checkpoints needs --overwrite, what an overwrite replaces survives
until the new run's first checkpoint commits, and every failure is one line from one process."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e import ONE_TOKEN_GRPO, REPO, env, experiment, nproc_args, process_tree, torchrun

from yatt.controllers.run import RECORD

FAST = (
    "rollout.engine.backend=hf",
    "rollout.engine.vllm=null",
)  # the plain decode loop starts in a moment on this tiny policy


def launch(config: Path, *args: str, cwd: Path, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        nproc_args(config, *FAST, *args),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**env(), **(extra_env or {})},
        cwd=cwd,
    )


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def contents(run_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run with a checkpoint at step 2, metrics, samples and an exported policy."""
    tmp = tmp_path_factory.mktemp("operator")
    config = experiment(
        tmp,
        f"{ONE_TOKEN_GRPO}checkpoint: {{every: 2, keep: 2}}\n"
        f"run: {{name: r, output_dir: {tmp / 'runs'}, steps: 2, eval_every: 0}}\n",
    )
    proc = launch(config, cwd=tmp)
    assert proc.returncode == 0 and "done:" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = tmp / "runs" / "r"
    assert (run_dir / "checkpoints" / "step-00000002" / "manifest.json").is_file()
    assert (run_dir / "samples.jsonl").is_file() and (run_dir / "summary.json").is_file()
    return tmp, config, run_dir


def bad_train_file(tmp: Path) -> Path:
    """The train rows with line 4 (rank 1's shard: only that rank can see it) not UTF-8."""
    lines_ = (tmp / "train.jsonl").read_bytes().splitlines(keepends=True)
    bad = tmp / "bad.jsonl"
    bad.write_bytes(b"".join(lines_[:3]) + b'{"prompt": "1+\xff="}\n' + b"".join(lines_[4:]))
    return bad


@pytest.mark.parametrize(
    "resume",
    [  # slow: one resume mode shows the data error comes first in CI; the others check the same order
        pytest.param(("--resume", "none"), id="none", marks=pytest.mark.slow),
        pytest.param(("--resume", "none", "--overwrite"), id="none-overwrite", marks=pytest.mark.slow),
        pytest.param(("--resume", "auto"), id="auto"),
    ],
)
def test_a_relaunch_with_bad_data_reports_the_data_error_and_changes_nothing(finished, resume):
    tmp, config, run_dir = finished
    bad = bad_train_file(tmp)
    before = contents(run_dir)
    # a different train file is also an incompatible config for auto; the data error is what is reported
    proc = launch(config, *resume, f"data.train.files=[{bad}]", cwd=tmp)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines(proc.stderr) == [f"error (rank 1): {bad}:4: not valid UTF-8 (byte 0xff at column 15)"], proc.stderr
    assert contents(run_dir) == before


def test_resume_none_over_checkpoints_is_refused_without_overwrite(finished):
    tmp, config, run_dir = finished
    before = contents(run_dir)
    proc = launch(config, "--resume", "none", cwd=tmp)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = lines(proc.stderr)
    assert line.startswith(f"error (rank 0): run {run_dir} has 1 checkpoint(s)") and "add --overwrite" in line, line
    assert contents(run_dir) == before


def test_a_bad_config_is_one_line_before_any_rank_starts(tmp_path):
    config = experiment(tmp_path, f"run: {{name: r, output_dir: {tmp_path / 'runs'}}}\n")
    proc = launch(config, "rollout.group_size=0", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    [line] = lines(proc.stderr)
    assert line.startswith(f"error: {config} with its command-line overrides: invalid config: rollout.group_size: "), (
        line
    )
    assert line.endswith("[command line: rollout.group_size=0]"), line
    assert not (tmp_path / "runs").exists()
    # plain torchrun: each rank checks it and rank 0 alone prints it (torchrun's own report follows). Rank 0 starts
    # late here: a rank 1 that exited first would have torchrun stop rank 0 before it printed
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "sitecustomize.py").write_text(SLOW_RANK0)
    faults = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "faults"), str(REPO)])}
    proc = torchrun(config, *FAST, "rollout.group_size=0", cwd=tmp_path, timeout=300, extra_env=faults)
    assert proc.returncode != 0 and [x for x in lines(proc.stderr) if x.startswith("error")] == [line], proc.stderr


SLOW_RANK0 = """import os, time
if os.environ.get("RANK") == "0":
    time.sleep(5)
"""


CRASH = """import os
if os.environ.get("RANK") == "1":  # a bug in one rank once the run directory is ready
    import yatt.controllers.run as run

    def build_components(*args, **kwargs):
        raise RuntimeError("injected crash")

    run.build_components = build_components
"""


def test_a_crash_in_one_rank_is_one_line_with_its_traceback_in_the_run_dir(tmp_path):
    config = experiment(tmp_path, f"run: {{name: r, output_dir: {tmp_path / 'runs'}, steps: 2}}\n")
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "sitecustomize.py").write_text(CRASH)
    proc = launch(
        config, cwd=tmp_path, extra_env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "faults"), str(REPO)])}
    )
    traceback = tmp_path / "runs" / "r" / "logs" / "rank1.traceback"
    assert proc.returncode == 1, proc.stderr[-3000:]
    # rank 0 was loading its model (progress bars on stderr) when the agent stopped it: no report, no traceback
    errors = [x for x in lines(proc.stderr) if x.startswith("error") or "Traceback" in x or "Error" in x]
    assert errors == [f"error (rank 1): RuntimeError: injected crash (traceback: {traceback})"], proc.stderr[-3000:]
    assert 'raise RuntimeError("injected crash")' in traceback.read_text()


def test_overwrite_keeps_the_old_run_until_the_new_one_commits(finished):
    """Last: it replaces the finished run. A kill -9 while the new run writes its first checkpoint leaves every
    byte of the old run set aside; the next launch commits, and only then is it deleted."""
    tmp, config, run_dir = finished
    before = contents(run_dir)
    ckpts = run_dir / "checkpoints"
    proc = subprocess.Popen(
        nproc_args(config, *FAST, "--resume", "none", "--overwrite", "checkpoint.debug_write_delay_s=1.0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        cwd=tmp,
    )
    deadline = time.monotonic() + 300
    while not any(".tmp-" in p.name for p in ckpts.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    for pid in process_tree(proc.pid):
        os.kill(pid, signal.SIGKILL)
    out = proc.communicate()[0]
    assert "replacing an earlier run's files: kept in" in out, out[-3000:]

    after = contents(run_dir)
    for rel, data in before.items():
        if rel.startswith("checkpoints/step-"):
            assert after[f"checkpoints/replaced/1/{rel.removeprefix('checkpoints/')}"] == data, rel
        elif rel.split("/")[0] in RECORD:
            assert after[f"replaced/1/{rel}"] == data, rel
    assert not list(ckpts.glob("step-*/manifest.json")), "the new run's first checkpoint was already complete"

    # the same command again (auto: nothing complete to resume): this launch commits, and what was set aside goes
    proc = launch(config, cwd=tmp)
    assert proc.returncode == 0 and "done:" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (run_dir / "replaced").exists() and not (ckpts / "replaced").exists()
    assert (ckpts / "step-00000002" / "manifest.json").is_file()
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
