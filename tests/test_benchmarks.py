"""Every script in benchmarks/ runs: each at its smallest settings, writing to a temporary folder, and its results
hold what the tables are made of and no machine paths. The numbers mean nothing at this size; the measurements
are in benchmarks/results/. (trainers.py with megatron: test_benchmark_trainers.py; controller_memory.py and
image_workload.py: test_controller_memory.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e import DIGITS, ONE_TOKEN_GRPO, env, experiment
from megatron_ranks import needs_megatron

from yatt.models.tiny import TinyModelConfig, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def run(script: str, *args: str, cwd: Path, torchrun: bool = False, timeout: int = 600) -> str:
    """`python benchmarks/<script> args` (or under torchrun with 2 ranks) from `cwd`; its stdout."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        if torchrun
        else [sys.executable]
    )
    proc = subprocess.run(
        [*launcher, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout, env=env(), cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def results(path: Path, tmp_path: Path) -> dict:
    """A results file's JSON, after checking it names no folder of this machine (the repository, the test's)."""
    text = path.read_text()
    for folder in (REPO, tmp_path, Path.home()):
        assert str(folder) not in text, (folder, text[:2000])
    return json.loads(text)


def test_balance(tmp_path):
    run(
        "balance.py",
        "--reps",
        "1",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "balance.json"),
        cwd=tmp_path,
        torchrun=True,
    )
    report = results(tmp_path / "balance.json", tmp_path)
    rows = {r["setup"]: r for r in report["rows"]}
    assert list(rows) == ["none", "balance", "balance+"] and report["world_size"] == 2
    assert rows["none"]["moved_samples"] == 0 and rows["balance"]["moved_samples"] > 0
    assert rows["balance"]["imbalance"] < rows["none"]["imbalance"]  # the skewed ranks are evened out
    assert all(len(r["step_s_all"]) == 1 and r["step_s_median"] > 0 for r in rows.values())


def test_checkpoint(tmp_path):
    small = write_tiny_model(tmp_path / "small", DIGITS)  # stands in for the quickstart policy
    run(
        "checkpoint.py",
        "--saves",
        "2",
        "--saves-small",
        "1",
        "--hidden",
        "48",
        "--layers",
        "1",
        "--quickstart",
        str(small),
        "--out",
        str(tmp_path / "checkpoint.json"),
        cwd=tmp_path,
    )
    models = results(tmp_path / "checkpoint.json", tmp_path)["results"]
    assert [m["model"] for m in models] == ["quickstart", "qwen2-h48x1"]
    for m, saves in zip(models, (1, 2)):
        assert m["params"] > 0 and m["state_bytes"] > 12 * m["params"]  # weights + AdamW's two moments, float32
        assert len(m["sync"]["stall_s"]) == len(m["async"]["stall_s"]) == saves
        assert m["async"]["write_after_stall_s"] > 0 and m["async_over_sync"] > 0


@needs_megatron
def test_checkpoint_megatron(tmp_path):
    out = tmp_path / "checkpoint_megatron.json"
    args = ["--megatron", "--tp", "2", "--saves", "2", "--hidden", "48", "--layers", "1", "--out", str(out)]
    run("checkpoint.py", *args, cwd=tmp_path, torchrun=True)
    (r,) = results(out, tmp_path)["results"]
    assert (r["tensor_parallel"], r["ranks"]) == (2, 2) and r["export_bytes"] > 4 * r["params_rank0"]
    for mode in ("state only", "state + export_hf"):
        assert len(r[mode]["stall_s"]) == 2 and r[mode]["stall_mean_s"] > 0


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
@pytest.mark.engine
def test_engines(tmp_path):
    run(
        "engines.py",
        "--hidden",
        "384",
        "--layers",
        "1",
        "--repeats-100m",
        "1",
        "--quickstart",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "engines"),
        cwd=tmp_path,
    )
    report = results(tmp_path / "engines.json", tmp_path)
    (workload,) = report["results"]
    assert workload["workload"] == "qwen2-h384x1" and list(workload["engines"]) == ["vllm", "hf"]
    for engine in workload["engines"].values():
        assert engine["sequences"] == 8 * 4 and engine["tokens"] > 0 and engine["tokens_per_s"] > 0
        assert len(engine["calls"]) == 1
    table = (tmp_path / "engines.md").read_text()
    assert "| qwen2-h384x1" in table and "| vllm |" in table and "| hf |" in table


def test_wire(tmp_path):
    out = run(
        "wire.py",
        "--junk-mb",
        "1",
        "--attackers",
        "1",
        "--calls",
        "2",
        "--new-tokens",
        "2",
        "--model",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "wire.json"),
        cwd=tmp_path,
    )
    report = results(tmp_path / "wire.json", tmp_path)
    assert report["attackers"] == 1 and report["junk_mb"] >= 1.0
    assert report["rpc_stats"]["refused_handshakes"] > 0  # the keyless senders never got through the handshake
    assert report["rpc_stats"]["served"] >= 2 * 2 + 3  # the honest calls, idle and under load, and the warm-up
    assert report["honest_idle_median_s"] > 0 and report["bulk_curve_mb_s"] > 0
    assert "under load: honest generate median" in out


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
def test_core_jitter(tmp_path):
    out = run(
        "core_jitter.py", "--chunks", "10", "--repeats", "2", "--out", str(tmp_path / "core_jitter"), cwd=tmp_path
    )
    report = results(tmp_path / "core_jitter.json", tmp_path)
    assert list(report["rows"]) == ["alone", "together #1", "lockstep #1", "together #2", "lockstep #2"]
    assert all(r["wall_s"] > 0 and r["chunk_ms_p99"] >= r["chunk_ms_median"] > 0 for r in report["rows"].values())
    assert len(report["lockstep_ratios"]) == 2 and all(r > 0 for r in report["lockstep_ratios"])
    assert "lockstep / together, wall time" in out


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
@pytest.mark.engine
def test_placement(tmp_path):
    run(
        "placement.py",
        "--steps",
        "1",
        "--prompts",
        "8",
        "--skip-quickstart",
        "--out",
        str(tmp_path / "placement"),
        cwd=tmp_path,
        timeout=900,
    )
    report = results(tmp_path / "placement.json", tmp_path)
    assert list(report) == ["long_tail"] and list(report["long_tail"]) == ["full", "partial"]
    for mode in report["long_tail"].values():
        assert mode["steps"] == 1 and mode["step_s"] > 0 and mode["genrm_busy_s"] > 0
        assert mode["response_len_max"] > mode["response_len_mean"]  # the long tail
    assert "| long_tail | partial/full |" in (tmp_path / "placement.md").read_text()


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
def test_step_time_trainer(tmp_path):
    """The 100m workload's trainer-only path, on a tiny model: the reference and one option, with the drift."""
    model = write_tiny_model(
        tmp_path / "model",
        TinyModelConfig(
            alphabet=DIGITS.alphabet,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            max_position_embeddings=256,
        ),
    )
    run(
        "step_time.py",
        "--workload",
        "100m",
        "--model",
        str(model),
        "--trainer-steps",
        "1",
        "--variants",
        "+packed",
        "--out",
        str(tmp_path / "step_time"),
        cwd=tmp_path,
    )
    report = results(tmp_path / "step_time.json", tmp_path)
    assert "quickstart" not in report and report["settings"]["model"] == "model"
    rows = report["100m"]
    assert [r["variant"] for r in rows] == ["all off", "+packed"]
    assert rows[0]["logprob_drift_max"] == 0.0 and rows[1]["logprob_drift_max"] < 1e-4  # packing: same log-probs
    assert all(r["trainer_s"] > 0 and r["peak_trainer_gib"] > 0 for r in rows)
    assert "| +packed |" in (tmp_path / "step_time.md").read_text()


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
@pytest.mark.engine
@needs_megatron
def test_step_time_rl_runs(tmp_path):
    """The quickstart workload: real 2-rank RL runs of a config (here the e2e tests' tiny one), one per variant."""
    # heads that split over the "megatron TP=2" variant's 2 tensor-parallel ranks, of a size vLLM's CPU kernels take
    model = DIGITS.model_copy(update={"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2})
    config = experiment(tmp_path, ONE_TOKEN_GRPO, model=model)
    run(
        "step_time.py",
        "--workload",
        "quickstart",
        "--config",
        str(config),
        "--steps",
        "4",
        "--variants",
        "all (defaults)",
        "megatron TP=2",
        "--out",
        str(tmp_path / "step_time"),
        cwd=tmp_path,
        timeout=900,
    )
    rows = results(tmp_path / "step_time.json", tmp_path)["quickstart"]
    assert [r["variant"] for r in rows] == ["all off", "all (defaults)", "megatron TP=2"]
    for r in rows:
        assert r["steps"] == 1 and r["step_s"] > 0 and r["update_s"] > 0 and len(r["peak_rss_gib"]) == 2
    report = (tmp_path / "step_time.md").read_text()
    assert "## exp.yaml (2 ranks, median of steps 4-4)" in report
    assert "megatron TP=2 / all (defaults), median step time: **" in report


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
def test_vl_step(tmp_path):
    """The VL step's per-rank figures at a tiny size, this checkout's two paths (no baseline checkout here)."""
    args = ["--prompts", "4", "--image-size", "56", "--group-size", "2", "--response-tokens", "4", "--steps", "1"]
    out = run("vl_step.py", *args, "--variants", "padded", "packed", "--out", str(tmp_path / "vl"), cwd=tmp_path)
    rows = results(tmp_path / "vl.json", tmp_path)["variants"]
    assert [r["variant"] for r in rows] == ["padded", "packed"] and "packed" in out
    for r in rows:
        assert r["samples_per_rank"] == [4, 4] and r["step_s"] > 0 and r["logprob_diff_max"] < 1e-4
        assert r["batch_pixel_dtypes"]["pixel_attention_mask"] == "torch.bool"
        assert r["batch_pixel_mib"] == r["rollout_pixel_mib"] > 0  # each prompt's pixels once


def test_committed_results_hold_no_machine_paths():
    """benchmarks/results/ is published: a path of the box that measured it means nothing elsewhere."""
    texts = [p for p in (BENCH / "results").iterdir() if p.suffix in (".json", ".md")]
    assert texts
    for path in texts:
        text = path.read_text()
        for prefix in ("/work/", "/tmp/", "/home/", "/root/", "/Users/", str(REPO)):
            assert prefix not in text, f"{path.name} records a machine path ({prefix}...)"


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
@pytest.mark.engine
def test_async(tmp_path):
    """The rollout schedules on a tiny config: one rank and its engine per schedule, evaluations at equal samples."""
    config = experiment(tmp_path, ONE_TOKEN_GRPO)
    out = run(
        "async.py",
        "--config",
        str(config),
        "--steps",
        "6",
        "--schedules",
        "sync",
        "async k=2",
        "--out",
        str(tmp_path / "async"),
        "rollout.engine.backend=hf",
        "rollout.engine.vllm=null",
        cwd=tmp_path,
    )
    rows = results(tmp_path / "async.json", tmp_path)["schedules"]
    assert [r["variant"] for r in rows] == ["sync", "async k=2"]
    sync, ahead = rows
    assert sync["staleness_max"] == 0 and ahead["staleness_max"] == 2 and ahead["dropped_stale"] == 0
    # evaluations at the same samples trained in every schedule
    assert [e["samples"] for e in sync["evals"]] == [e["samples"] for e in ahead["evals"]] == [0, 128, 256, 384]
    assert all(r["samples_per_s"] > 0 and 0 < r["trainer_busy"] <= 1 for r in rows)
    assert "samples_per_s / sync" in out


@pytest.mark.engine
def test_weight_sync(tmp_path):
    """zmq and shm syncs of the quickstart-shaped policy into one hf engine: the socket carries only descriptors."""
    out = run(
        "weight_sync.py", "--models", "quickstart", "--engines", "hf", "--repeats", "1", "--out", str(tmp_path / "ws"),
        cwd=tmp_path,
    )  # fmt: skip
    report = results(tmp_path / "ws.json", tmp_path)
    got = report["results"]["quickstart/hf"]
    assert len(got["zmq"]["seconds"]) == len(got["shm"]["seconds"]) == 1
    assert got["zmq"]["socket_bytes"][0] > got["weight_bytes"] > 100 * got["shm"]["socket_bytes"][0]
    assert "| quickstart | 0.79M | hf | shm |" in (tmp_path / "ws.md").read_text() and "shm" in out
