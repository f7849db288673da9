"""Runs people can watch: TensorBoard event files, samples.jsonl, the plot PNG, eval/accuracy vs eval/score."""

import json
import subprocess
import sys

import pytest

from yatt.config import RunConfig
from yatt.controllers.metrics import MetricsLogger
from yatt.controllers.samples import sample_records
from yatt.controllers.sinks import open_sinks
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow
from yatt.plot import plot_run


def fake_history(path, steps=6):
    with open(path, "w") as f:
        for step in range(steps + 1):
            record = {"step": step}
            if step % 3 == 0:
                record.update({"eval/accuracy": 0.1 * step, "eval/score": 0.15 * step})
            if step:
                record.update(
                    {
                        "reward/mean": 0.1 * step,
                        "reward/correct_frac": 0.05 * step,
                        "actor/entropy": 1 / step,
                        "response/length_mean": 10.0 + step,
                        "response/length_max": 20.0,
                        "time/generate_s": 0.5,
                        "time/update_s": 0.3,
                        "time/sync_s": 0.05,
                    }
                )
            f.write(json.dumps(record) + "\n")


def test_tensorboard_event_file_next_to_metrics(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunConfig(name="watch", output_dir=tmp_path)
    run.run_dir.mkdir(parents=True)
    log = MetricsLogger(run.run_dir / "metrics.jsonl", 3, enabled=True, sinks=open_sinks(run, {}))
    for step in range(1, 4):
        log.log(step, {"reward/mean": 0.25 * step, "eval/accuracy": 0.5, "eval/score": 0.75})
    log.close()
    assert "eval acc 0.500 score 0.750" in capsys.readouterr().out
    events = list((run.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "eval/score" in acc.Tags()["scalars"]


def test_no_sinks_when_switched_off(tmp_path):
    assert open_sinks(RunConfig(output_dir=tmp_path, tensorboard=False), {}) == []


def test_plot_writes_a_png(tmp_path):
    fake_history(tmp_path / "metrics.jsonl")
    out = plot_run(tmp_path, tmp_path / "plots" / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    proc = subprocess.run([sys.executable, "-m", "yatt.plot", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0 and (tmp_path / "curves.png").is_file()
    proc = subprocess.run([sys.executable, "-m", "yatt.plot", str(tmp_path / "nope")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "metrics.jsonl: not found" in proc.stderr


def test_sample_records_show_prompts_responses_rewards_and_judges():
    rows = [PromptRow(i, f"{i}+1=", None, str(i + 1), "exact_match") for i in range(3)]
    train = [
        Rollout(
            rows[i // 2],
            [1],
            [2, 3],
            [0.0, 0.0],
            "stop",
            text=f"r{i}",
            reward=float(i % 2),
            rule_score=float(i % 2),
            judge_scores={"judge": 0.5},
        )
        for i in range(6)
    ]
    evals = [Rollout(r, [1], [2], [], "stop", text=r.answer, reward=1.0) for r in rows]
    records = sample_records(7, evals, train, count=2)
    assert [(r["split"], r["index"]) for r in records] == [("eval", 0), ("eval", 1), ("train", 0), ("train", 1)]
    assert records[0] == {
        "step": 7,
        "split": "eval",
        "index": 0,
        "prompt": "0+1=",
        "answer": "1",
        "data_source": "exact_match",
        "response": "1",
        "score": 1.0,
    }
    group = records[3]["responses"]
    assert [g["text"] for g in group] == ["r2", "r3"] and group[1]["reward"] == 1.0
    assert group[0]["judge_scores"] == {"judge": 0.5} and group[0]["tokens"] == 2


@pytest.mark.parametrize("setting", ["run.tensorboard=true", "run.wandb.enabled=true"])
def test_missing_package_is_a_config_error(tmp_path, monkeypatch, setting):
    import importlib.util

    from yatt.config import load_experiment
    from yatt.config_loading import ConfigError
    from yatt.models.tiny import write_tiny_model
    from yatt.preflight import check_run

    write_tiny_model(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1"}\n')
    (tmp_path / "c.yaml").write_text(
        f"model: {{path: {tmp_path / 'm'}}}\ndata: {{train: {{kind: jsonl, files: [{tmp_path / 'd.jsonl'}]}}}}\n"
    )
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a)
    )
    cfg = load_experiment(tmp_path / "c.yaml", [setting])
    with pytest.raises(ConfigError, match=rf"{setting} needs the \w+ package: pip install 'yatt\["):
        check_run(cfg, 1, "c.yaml")


def test_a_resumed_logger_runs_elapsed_on_and_counts_eta_from_its_own_steps(tmp_path):
    """After a resume at step 600 of 700 (5000 s logged), elapsed continues from 5000 s and the ETA comes from
    this launch's pace, not from 5000 s spread over 601 steps."""
    log = MetricsLogger(tmp_path / "m.jsonl", 700, enabled=True, resumed=(600, 5000.0))
    log.log(601, {"reward/mean": 0.5})
    log.close()
    record = json.loads((tmp_path / "m.jsonl").read_text())
    assert 5000.0 <= record["elapsed_s"] < 5060.0
    assert log.console_line(601, {}, 5010.0).endswith("1:23:30 elapsed, eta 0:16:30")  # 10 s a step, 99 to go
    assert log.console_line(600, {}, 5000.0).endswith("1:23:20 elapsed")  # no step of this launch yet: no ETA
