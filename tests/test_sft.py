"""SFT of a tiny model: a short run writes a loadable HF folder; data files; config errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from yatt.config_loading import ConfigError, load_config
from yatt.quickstart.addition import addition_rows, read_jsonl, write_addition_files
from yatt.quickstart.sft import SFTConfig, exact_match, run_sft

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "addition"


def test_short_sft_run_writes_loadable_folder(tmp_path):
    torch.set_num_threads(1)
    paths = write_addition_files(tmp_path / "data", seed=1, sizes={"sft": 2000, "train": 10, "eval": 40})
    out = tmp_path / "policy"
    cfg = SFTConfig(
        model={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
        sft_file=paths["sft"],
        eval_file=paths["eval"],
        output_dir=out,
        batch_size=32,
        max_steps=30,
        eval_every=10,
        eval_examples=20,
        stop_at_accuracy=1.0,
    )
    summary = run_sft(cfg, log=lambda msg: None)

    assert summary["steps"] == 30 and summary["stopped_by"] == "max_steps"
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]
    assert json.loads((out / "sft_summary.json").read_text())["steps"] == 30
    assert not list(tmp_path.glob("policy.tmp-*"))

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    ids = tokenizer("123+456=", return_tensors="pt", add_special_tokens=False).input_ids
    assert model(ids).logits.shape == (1, 8, len(tokenizer))

    # A second stage continues from the first model (init_from) instead of a fresh one.
    stage2 = cfg.model_copy(
        update={
            "init_from": out,
            "output_dir": tmp_path / "stage2",
            "max_steps": 10,
            "eval_every": 10,
            "warmup_steps": 0,
            "lr_schedule": "cosine",
        }
    )
    summary2 = run_sft(stage2, log=lambda msg: None)
    assert summary2["params"] == summary["params"]
    assert summary2["history"][0]["loss"] < summary["history"][0]["loss"]  # starts where stage 1 ended


def test_addition_files_are_disjoint_and_documented():
    files = {name: read_jsonl(DATA / f"{name}.jsonl") for name in ("sft", "train", "eval")}
    assert {name: len(rows) for name, rows in files.items()} == {"sft": 20000, "train": 10000, "eval": 500}
    pairs = {}
    for name, rows in files.items():
        for row in rows:
            assert set(row) == {"prompt", "answer", "data_source"} and row["data_source"] == "addition"
            a, b = map(int, row["prompt"].removesuffix("=").split("+"))
            assert 100 <= a <= 999 and 100 <= b <= 999 and row["answer"] == str(a + b)
        pairs[name] = {row["prompt"] for row in rows}
        assert len(pairs[name]) == len(rows)
    assert not pairs["sft"] & pairs["train"] and not pairs["sft"] & pairs["eval"] and not pairs["train"] & pairs["eval"]
    assert addition_rows(5, seed=3) == addition_rows(5, seed=3)


def test_exact_match():
    assert exact_match(" 579\n", "579") and not exact_match("5790", "579") and not exact_match("", "579")


def test_unknown_config_key_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sft_file: a.jsonl\neval_file: b.jsonl\noutput_dir: out\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, path)
    assert "learning_rate" in str(err.value) and str(path) in str(err.value)

    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "sft.py"), "--config", str(path), "model.hidden=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "learning_rate" in result.stderr and "model.hidden" in result.stderr and str(path) in result.stderr


def test_an_existing_folder_is_kept_only_when_its_config_is_this_one(tmp_path, capsys):
    """launch/sft.py skips a folder trained from the same config, and refuses, naming the fields, one trained from
    another (an older checkout's warm-up would otherwise start a run from the wrong policy)."""
    import importlib.util

    from yatt.config_loading import dump_config

    spec = importlib.util.spec_from_file_location("launch_sft", REPO / "launch" / "sft.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    config = tmp_path / "sft.yaml"
    config.write_text(f"sft_file: a.jsonl\neval_file: b.jsonl\noutput_dir: {tmp_path / 'out'}\nlr: 0.001\n")
    (tmp_path / "out").mkdir()
    dump_config(load_config(SFTConfig, config), tmp_path / "out" / "sft_config.yaml")
    assert launch.main(["--config", str(config)]) == 0
    assert "already exists; skipping" in capsys.readouterr().out
    assert launch.main(["--config", str(config), "lr=0.002", "seed=3"]) == 2
    err = capsys.readouterr().err
    assert "trained from another config" in err and "lr, seed" in err and "--force" in err
