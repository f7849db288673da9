"""Draw a run's curves to a PNG: reward, held-out accuracy, entropy, response length and stage times.

    python -m yatt.plot RUN_DIR [--out FILE.png]      # default: RUN_DIR/curves.png

Reads RUN_DIR/metrics.jsonl (needs matplotlib: pip install 'yatt[watch]').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STAGES = ("generate", "reward", "balance", "logprobs", "advantages", "update", "sync")
PANELS = (  # (title, [(metric, label)])
    ("reward", [("reward/mean", "mean"), ("reward/correct_frac", "full-score fraction")]),
    ("held-out eval", [("eval/accuracy", "accuracy"), ("eval/score", "mean score")]),
    ("entropy", [("actor/entropy", "policy entropy")]),
    ("response length (tokens)", [("response/length_mean", "mean"), ("response/length_max", "max")]),
)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {run_dir} a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(run_dir: Path, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("python -m yatt.plot needs matplotlib: pip install 'yatt[watch]'") from None
    records = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(5 * (len(PANELS) + 1), 3.6))
    for ax, (title, keys) in zip(axes, PANELS):
        for key, label in keys:
            steps, values = series(records, key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    ax = axes[-1]
    train = [r for r in records if "time/generate_s" in r]
    bottom = [0.0] * len(train)
    for stage in STAGES:
        values = [r.get(f"time/{stage}_s", 0.0) for r in train]
        if any(values):
            ax.bar([r["step"] for r in train], values, bottom=bottom, width=1.0, label=stage)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title("stage seconds per step (slowest rank)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run directory (with metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.out or args.run_dir / "curves.png")
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
