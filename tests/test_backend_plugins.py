"""Backends from outside yatt, each one file under tests/plugins/ and named by import path in the YAML, train for
real: one step through `ControllerShard.step()` (the trainer in this process, the engine in the process yatt
starts for it, which imports the plug-in by the same path), and two steps under torchrun on 2 ranks."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from e2e import experiment, torchrun

from yatt.config import load_experiment
from yatt.config_loading import ConfigError
from yatt.controllers.components import build_components
from yatt.controllers.shard import ControllerShard
from yatt.distributed import World
from yatt.engines.client import engine_env, plugin_root
from yatt.engines.config import EngineConfig
from yatt.preflight import check_run

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
TRAINER = "tests.plugins.counting_trainer:CountingTrainer"
ENGINE = "tests.plugins.counting_engine:CountingEngine"


def plugin_experiment(tmp_path, log: str) -> str:
    return str(
        experiment(
            tmp_path,
            f"""
rollout: {{group_size: 8, max_new_tokens: 2, engine: {{backend: {ENGINE}, startup_timeout_s: 300}}}}
algorithm: {{mini_batches: 2}}
trainer: {{backend: {TRAINER}, counting: {{log: {log}}}, lr: 0.01, micro_batch_size: 16}}
run: {{output_dir: {tmp_path / "runs"}}}
""",
        )
    )


@pytest.mark.engine
def test_plugin_trainer_and_engine_by_import_path_run_a_step(tmp_path, monkeypatch):
    calls = tmp_path / "calls.jsonl"
    config = plugin_experiment(tmp_path, str(calls))
    cfg = load_experiment(config)
    assert cfg.trainer.backend_config.log == calls  # the plug-in's own section, validated by its class
    check_run(cfg, 1, config)  # its preflight passes (the log's folder exists)
    monkeypatch.chdir(tmp_path)  # the engine process starts elsewhere than the repository
    parts = build_components(cfg, WORLD, tmp_path / "run")
    shard = ControllerShard(cfg, WORLD, parts)
    try:
        metrics = shard.step(1).metrics
        health = parts.engines.local["rollout"].health()
    finally:
        shard.close()

    assert type(parts.trainer).__name__ == "CountingTrainer" and metrics["rollout/samples"] == 64
    assert metrics["actor/grad_norm"] > 0
    lines = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [line["rows"] for line in lines if line["call"] == "train_mini_batch"] == [32, 32]  # 2 mini-batches
    # the engine process served the step with the plug-in class: 8 prompts, 8 samples each, 1-2 tokens a sample
    assert health["backend"] == "counting" and health["pid"] != os.getpid()
    assert health["requests"] == 8 and 64 <= health["tokens"] <= 128


@pytest.mark.engine
def test_plugins_train_under_torchrun_from_another_directory(tmp_path):
    """The launcher's path: 2 ranks check the config (the plug-in's preflight included), train through the plug-in
    trainer and generate with the plug-in engine, each rank's in its own engine process."""
    calls = tmp_path / "calls.jsonl"
    config = plugin_experiment(tmp_path, str(calls))
    done = torchrun(
        config, "run.steps=2", "run.eval_every=0", "checkpoint.every=0", "run.export_policy=false", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in calls.read_text().splitlines()]
    # per rank and step: 4 prompts x 8 samples in 2 mini-batches of 16
    assert (
        sorted((line["rank"], line["rows"]) for line in lines if line["call"] == "train_mini_batch")
        == [(0, 16)] * 4 + [(1, 16)] * 4
    )
    logs = sorted((tmp_path / "runs" / "run" / "logs").glob("engine-rollout-rank*.log"))
    served = [re.search(r"counting engine served (\d+) requests", log.read_text()) for log in logs]
    assert len(logs) == 2 and all(found and int(found[1]) >= 8 for found in served), logs  # 4 prompts x 2 steps


def test_plugin_preflight_and_section_errors_name_the_field(tmp_path):
    config = plugin_experiment(tmp_path, str(tmp_path / "missing" / "calls.jsonl"))
    with pytest.raises(ConfigError, match="trainer.counting.log: folder not found"):
        check_run(load_experiment(config), 1, config)
    with pytest.raises(ConfigError, match="trainer.counting.logs: unknown key"):
        load_experiment(config, ["trainer.counting.logs=x"])
    with pytest.raises(ConfigError, match="trainer.counting.log: Field required"):
        load_experiment(config, ["trainer.counting=null"])
    with pytest.raises(ConfigError, match="trainer.backend: cannot import 'tests.plugins.nope'"):
        load_experiment(config, ["trainer.backend=tests.plugins.nope:Trainer"])


def test_an_engine_process_imports_a_plugin_from_where_this_process_did(tmp_path, monkeypatch):
    """A plug-in found through this process's sys.path only (not PYTHONPATH, not the engine's working directory)
    is on the engine process's PYTHONPATH."""
    (tmp_path / "ext" / "my_engines").mkdir(parents=True)
    (tmp_path / "ext" / "my_engines" / "__init__.py").write_text("")
    (tmp_path / "ext" / "my_engines" / "hf.py").write_text("from yatt.engines.hf_engine import HFEngine as Engine\n")
    monkeypatch.syspath_prepend(str(tmp_path / "ext"))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    cfg = EngineConfig(backend="my_engines.hf:Engine")
    assert cfg.backend_config is None  # a plug-in without a section of its own
    assert plugin_root(cfg.backend) == str(tmp_path / "ext")
    env = engine_env(cfg)
    assert str(tmp_path / "ext") in env["PYTHONPATH"].split(os.pathsep)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # vLLM's variables come from the vLLM backend only
