"""Routing replay side by side on the MoE quickstart: algorithm.routing_replay off, r2 and r3, with the engine
in float32 like the trainer (the quickstart's) and in bfloat16 (numerics that differ, as a bf16 GPU engine's do).

    OMP_NUM_THREADS=1 python benchmarks/moe.py [--steps 100] [--nproc 2] [--variants off r2 r3 ...]
        [--config configs/quickstart_moe.yaml] [--out benchmarks/results/moe] [--note TEXT] [OVERRIDE ...]

Needs the quickstart's SFT'd policy (models/quickstart-moe-policy: `python launch/sft.py --config
configs/sft_quickstart_moe.yaml`, or `make quickstart-moe`). OVERRIDEs (`a.b=c`) go to every run.

Each variant is a real run, one after the other (never two at once), of `launch/train.py --config <config>
--placement full algorithm.routing_replay=<r> algorithm.routing_mismatch=true` (", bf16 engine":
rollout.engine.dtype=bfloat16) for --steps steps, from the
same policy, data and seeds (the config's schedule and cosine lr over --steps), with a held-out evaluation every
--steps / 3 steps and at the end. Dynamic sampling is off: it carries kept groups beyond a step's need over to the
next step, generated before the last update, so their gap would measure that update, not the engine/trainer
mismatch (and every step trains the same number of samples). routing_mismatch makes the hf engines return the experts of
every token under off and r2 too (r3 needs them anyway), so all three are measured the same way:

- the engine/trainer log-prob gap: |engine log-prob - trainer old log-prob| over the response tokens
  (rollout/trainer_logprob_diff_mean, the mean over steps; rollout/trainer_logprob_diff_max, the max over steps);
- the routing mismatch: the fraction of response tokens whose top-k experts in the trainer's first pass, the
  router's own choice before any replay, differ from the engine's in some MoE layer (moe/routing_mismatch), and
  the same per token and layer (moe/routing_mismatch_layers), means over steps;
- held-out accuracy at equal steps; the median step time (the first WARMUP_STEPS left out).

Under r3 the trainer's old-log-prob pass runs on the engine's experts, so its log-prob gap is the kernels' alone;
under off and r2 (whose old-log-prob pass is the trainer's own routing, replayed only in the update) it also
carries the tokens routed differently. Writes <out>.json and <out>.md (per engine dtype, ratios to off); --report
rebuilds <out>.md from <out>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import harness
from harness import run_training, shown, slug, write_results

REPO = Path(__file__).resolve().parents[1]
BF16 = ["rollout.engine.dtype=bfloat16"]  # the engine in bfloat16, the trainer in float32: numerics that differ
VARIANTS = {  # name: overrides
    "off": ["algorithm.routing_replay=off"],
    "r2": ["algorithm.routing_replay=r2"],
    "r3": ["algorithm.routing_replay=r3"],
    "off, bf16 engine": ["algorithm.routing_replay=off", *BF16],
    "r2, bf16 engine": ["algorithm.routing_replay=r2", *BF16],
    "r3, bf16 engine": ["algorithm.routing_replay=r3", *BF16],
}
WARMUP_STEPS = 3  # left out of the step-time median


def run_variant(name: str, args: argparse.Namespace, work: Path) -> dict:
    overrides = [
        "--placement",
        "full",
        f"run.steps={args.steps}",
        f"run.eval_every={max(1, args.steps // 3)}",
        "checkpoint.every=0",
        # dynamic sampling queues the kept groups beyond a step's need for the next step: generated with the weights
        # before the last update, their log-probs and routing differ from the trainer's by that update too
        "algorithm.dynamic_sampling.enabled=false",
        *VARIANTS[name],
        "algorithm.routing_mismatch=true",
        *args.overrides,
    ]
    start = time.perf_counter()
    records = run_training(
        f"variant {name!r}", args.config, args.nproc, overrides, work, "replay_" + slug(name.replace(",", ""))
    )
    steps = [r for r in records if r.get("step", 0) > 0 and "time/step_s" in r]
    timed = [r for r in steps if r["step"] > WARMUP_STEPS] or steps
    evals = [{"step": r["step"], "accuracy": r["eval/accuracy"]} for r in records if "eval/accuracy" in r]
    # a step that trained nothing (dynamic sampling kept no group) logs no routing mismatch
    measured = [r for r in steps if "moe/routing_mismatch" in r]
    mean = lambda key, rows=steps: statistics.mean(r[key] for r in rows) if rows else float("nan")  # noqa: E731
    return {
        "variant": name,
        "logprob_gap_mean": mean("rollout/trainer_logprob_diff_mean"),
        "logprob_gap_max": max(r["rollout/trainer_logprob_diff_max"] for r in steps),
        "logprob_gap_max_median": statistics.median(r["rollout/trainer_logprob_diff_max"] for r in steps),
        "routing_mismatch": mean("moe/routing_mismatch", measured),
        "routing_mismatch_layers": mean("moe/routing_mismatch_layers", measured),
        "routing_mismatch_steps": len(measured),
        "accuracy_start": evals[0]["accuracy"],
        "accuracy_end": evals[-1]["accuracy"],
        "step_s": statistics.median(r["time/step_s"] for r in timed),
        "logprobs_s": statistics.median(r["time/logprobs_s"] for r in timed),
        "update_s": statistics.median(r["time/update_s"] for r in timed),
        "generate_s": statistics.median(r["time/generate_s"] for r in timed),
        "evals": evals,
        "per_step": [
            {
                "step": r["step"],
                "logprob_gap_mean": r["rollout/trainer_logprob_diff_mean"],
                "logprob_gap_max": r["rollout/trainer_logprob_diff_max"],
                "routing_mismatch": r.get("moe/routing_mismatch"),
                "step_s": r["time/step_s"],
            }
            for r in steps
        ],
        "wall_s": time.perf_counter() - start,
    }


COLUMNS = [  # (key, title, format); the log-prob gaps to 3 significant digits: ~1e-7 in float32, ~1e-2 in bf16
    ("logprob_gap_mean", "log-prob gap mean", ".3g"),
    ("logprob_gap_max", "log-prob gap max", ".3g"),
    ("logprob_gap_max_median", "per-step max (median)", ".3g"),
    ("routing_mismatch", "routing mismatch", ".4f"),
    ("routing_mismatch_layers", "mismatch (layers)", ".4f"),
    ("accuracy_start", "held-out acc (start)", ".3f"),
    ("accuracy_end", "held-out acc (end)", ".3f"),
    ("step_s", "step s (median)", ".3f"),
    ("logprobs_s", "logprobs s", ".3f"),
    ("update_s", "update s", ".3f"),
    ("wall_s", "run wall s", ".1f"),
]
RATIOS = [("logprob_gap_mean", "gap mean"), ("logprob_gap_max", "gap max"), ("step_s", "step s")]


def tables(rows: list[dict]) -> list[str]:
    """One table per engine dtype (float32, bfloat16), each with its ratios to its first variant (off)."""
    out = []
    for engine in ("float32", "bfloat16"):
        group = [r for r in rows if ("bf16 engine" in r["variant"]) == (engine == "bfloat16")]
        if not group:
            continue
        ref = group[0]
        head = [title for _, title, _ in COLUMNS] + [f"{title} / {ref['variant']}" for _, title in RATIOS]
        out += [f"Engine in {engine}:", "", "| variant | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
        for r in group:
            cells = [format(r[k], f) for k, _, f in COLUMNS]
            cells += [f"{r[k] / ref[k]:.2f}x" if ref[k] else "-" for k, _ in RATIOS]
            out.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def report(rows: list[dict], settings: dict, date: str, commit: str, command: str) -> list[str]:
    """The markdown report of a run's rows (also rebuilt from <out>.json by --report)."""
    return [
        f"# Routing replay: {' '.join([settings['config'], *settings['overrides']])}, {settings['nproc']} trainer "
        f"rank(s) + engine(s), {settings['steps']} steps per variant\n",
        f"{date}, commit {commit}: `OMP_NUM_THREADS=1 {command}`\n",
        *([settings["note"], ""] if settings["note"] else []),
        "Log-prob gap: |engine - trainer old log-prob| per response token (mean over tokens and steps; max over "
        "all; the median over steps of each step's max). Routing mismatch: the share of response tokens predicted "
        "at a position where the router's own top-k in the trainer's first pass, before replay, differs from the "
        "engine's in some MoE layer (`layers`: per token and layer), mean over steps. Dynamic sampling off.\n",
        *tables(rows),
        "Held-out accuracy at equal steps:",
        "",
        "| variant | " + " | ".join(f"step {e['step']}" for e in rows[0]["evals"]) + " |",
        "|---|" + "---|" * len(rows[0]["evals"]),
        *(f"| {r['variant']} | " + " | ".join(f"{e['accuracy']:.3f}" for e in r["evals"]) + " |" for r in rows),
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (each with its engine)")
    parser.add_argument("--config", type=Path, default=REPO / "configs/quickstart_moe.yaml")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/moe")
    parser.add_argument("--note", default="", help="a line about the machine and what else ran, for the report")
    parser.add_argument("--report", action="store_true", help="rebuild <out>.md from <out>.json; run nothing")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(Path(f"{args.out}.json").read_text())
        md = report(saved["variants"], saved["settings"], saved["date"], saved["commit"], saved["command"])
        write_results(args.out, saved, md)
        return 0
    if args.steps <= 0:
        parser.error("--steps: at least 1")
    summary = lambda r: (  # noqa: E731
        f"log-prob gap mean {r['logprob_gap_mean']:.2e} max {r['logprob_gap_max']:.3f}, routing mismatch "
        f"{r['routing_mismatch']:.3f}, accuracy {r['accuracy_start']:.3f} -> {r['accuracy_end']:.3f}, "
        f"step {r['step_s']:.3f} s"
    )
    rows = harness.run_variants(args.variants, lambda name, work: run_variant(name, args, work), summary, "yatt-moe-")
    settings = harness.settings(args)
    commit = harness.commit()
    argv = [shown(a) if a.startswith("/") else a for a in sys.argv[1:]]
    if "--note" in argv:  # the note is its own line of the report
        argv[argv.index("--note") + 1] = "TEXT"
    command = " ".join(["python benchmarks/moe.py", *argv])
    run = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip() or "unknown", "command": command}
    md = report(rows, settings, **run)
    write_results(args.out, {**run, "settings": settings, "variants": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
