"""What the trainer benchmarks share: /proc memory readings (proc_memory.vm_kib), one torchrun job per variant
whose ranks each write a JSON result, and markdown tables with ratios to a reference row.

Imported by the scripts in this folder (running `python benchmarks/X.py` puts this folder on sys.path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proc_memory import vm_kib  # noqa: F401  (re-exported: the trainer benchmarks read /proc through harness)


def shown(path: str | Path) -> str:
    """A path as results files record it: relative to the repository when inside it (no machine paths)."""
    path = Path(path).resolve()
    root = Path(__file__).resolve().parents[1]
    return str(path.relative_to(root)) if path.is_relative_to(root) else path.name


def run_variants(
    names: list[str], run: Callable[[str, Path], dict], summary: Callable[[dict], str], prefix: str
) -> list[dict]:
    """`run(name, work)` for each variant in turn, in one temporary work folder, its `summary` printed as it ends."""
    rows = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for name in names:
            print(f"{name} ...", flush=True)
            rows.append(run(name, Path(tmp)))
            print(f"  {summary(rows[-1])}", flush=True)
    return rows


def commit() -> str:
    """The checkout's short commit, as results record it."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """A script's parsed arguments as results record them (paths shown relative: no machine paths)."""
    return {k: (shown(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def slug(name: str) -> str:
    """A variant's name as a file name."""
    return name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "plus_").replace("=", "")


def rank_result(result: str | Path, rank: int, suffix: str = ".json") -> Path:
    """Where rank `rank` of a worker started by run_worker writes its result."""
    return Path(result).with_suffix(f".rank{rank}{suffix}")


def add_worker_args(parser: argparse.ArgumentParser, *names: str) -> None:
    """The hidden flags of a script's worker mode: --worker and --result, which run_worker passes, and the
    script's own string options `names` (e.g. "--trainer")."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in (*names, "--result"):
        parser.add_argument(name, help=argparse.SUPPRESS)


def run_worker(name: str, script: Path, worker_args: list[str], result: Path, code: Path, nproc: int = 2) -> list[dict]:
    """`script --worker --result <result> *worker_args` on `nproc` ranks under torchrun, one compute thread each,
    importing yatt from `code`; its output goes to <result>.log. Returns what each rank wrote to
    rank_result(result, rank), by rank."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        str(script.resolve()),
        "--worker",
        "--result",
        str(result),
        *worker_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code)}
    with open(f"{result}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"variant {name!r} failed (exit {rc}); see {result}.log")
    return [json.loads(rank_result(result, r).read_text()) for r in range(nproc)]


def run_training(what: str, config: Path, nproc: int, overrides: list[str], work: Path, run_name: str) -> list[dict]:
    """One real run of launch/train.py (`nproc` ranks, from scratch, run dir work/run_name, no final export) with
    `overrides`, one compute thread per process, its output in work/run_name.log; its metrics.jsonl records. A
    failure raises with the end of the log."""
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "launch/train.py", "--nproc", str(nproc), "--config", str(config.resolve())]
    cmd += ["--resume", "none", f"run.output_dir={work}", f"run.name={run_name}", "run.export_policy=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    with open(work / f"{run_name}.log", "w") as log:
        rc = subprocess.run([*cmd, *overrides], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = (work / f"{run_name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{what} failed (exit {rc}); the end of its log:\n{tail}")
    return [json.loads(line) for line in (work / run_name / "metrics.jsonl").read_text().splitlines()]


def write_results(out: str | Path, results: dict, md: list[str]) -> None:
    """A benchmark's results next to each other: `out`.json (the numbers) and `out`.md (the report, also printed)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=2) + "\n")
    Path(f"{out}.md").write_text("\n".join(md))
    print("\n".join(md))


def cell(value) -> str:
    """Floats to 3 decimals, or 3 significant digits when smaller than that shows (a log-prob drift of 1e-6)."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:.3f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.2e}"


def table(rows: list[dict], columns: list[tuple[str, str]], ratio_of: list[str]) -> str:
    """A markdown table of `columns` (key, title), one line per row, and for each key in `ratio_of` the ratio
    of the row's value to the first row's (the reference)."""
    reference = rows[0]
    head = (
        "| variant | "
        + " | ".join(title for _, title in columns)
        + " | "
        + " | ".join(f"{k} / {reference['variant']}" for k in ratio_of)
        + " |"
    )
    lines = [head, "|" + "---|" * (1 + len(columns) + len(ratio_of))]
    for r in rows:
        cells = [cell(r[k]) for k, _ in columns]
        ratios = [f"{r[k] / reference[k]:.2f}x" if reference[k] else "-" for k in ratio_of]
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on a file-only backend, or None (printed) when matplotlib is not installed: the
    benchmarks still write their tables and JSON without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def smollm2_shaped(folder: Path, tokenizer: Any = None) -> Path:
    """A random-weight Llama with SmolLM2-135M's shape (a stand-in where the converted model is not at hand,
    docs/smollm2.md), with `tokenizer`'s special ids and files if given; kept if `folder` already holds one."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = (
        (1, 2, None) if tokenizer is None else (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
        bos_token_id=ids[0],
        eos_token_id=ids[1],
        pad_token_id=ids[2],
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
