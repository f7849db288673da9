"""Rollout schedules side by side on the quickstart task: sync, one_step_off, async with max_staleness 1, 2, 4.

    OMP_NUM_THREADS=1 python benchmarks/async.py [--steps 150 | --as-configured] [--nproc 1] [--schedules NAME ...]
        [--config configs/quickstart.yaml] [--out benchmarks/results/async] [OVERRIDE ...]

OVERRIDEs (`a.b=c`) go to every run, e.g. `rollout.engine.backend=vllm rollout.engine.vllm.kv_cache_gib=1`.

Layout: --nproc trainer ranks (default 1), each with its rollout engine (a child process with one thread): on the
2-core box, one trainer rank and its engine on separate cores. Each schedule is a real run, one after the other
(never two at once), of `launch/train.py --config <config> --placement full rollout.schedule.mode=...` for --steps
steps, on the same data and seeds, with dynamic sampling off (every step trains the same number of samples, so
runs compare at equal samples trained) and a held-out evaluation every --steps / 3 steps and at the end.

Per schedule: samples/s over the RL steps (samples trained / the sum of step times), the median step time, the
trainer's busy fraction (logprobs + update + sync over the step's wall time) and the rollout engines' (their
stepping time, load/rollout_busy_s, over the step's wall time), held-out accuracy at each evaluation (equal samples
trained for every schedule), and the staleness of what was trained (mean, max) with the samples dropped as
older than max_staleness (only groups dynamic sampling carries over can be; it is off here). async with
max_staleness 1 is one_step_off by construction (docs/async.md): the same run, timed again.

--as-configured runs the config as it is (its steps, evaluations and dynamic sampling: the quickstart itself)
and adds nothing but the schedule, to compare whole runs' wall time and final accuracy.

Writes <out>.json, <out>.md (samples/s ratios to sync) and <out>.png (held-out accuracy against samples trained,
and samples/s per schedule).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import harness
from harness import pyplot, run_training, shown, slug, table, write_results

REPO = Path(__file__).resolve().parents[1]
PINNED = ["run.cores=[0]", "rollout.engine.cores=[1]"]
SCHEDULES = {  # name: overrides
    "sync": ["rollout.schedule.mode=sync"],
    # the truncated IS weight on the sync schedule too, so the + TIS rows compare against like
    "sync + TIS": ["rollout.schedule.mode=sync", "algorithm.rollout_is.mode=truncate"],
    "one_step_off": ["rollout.schedule.mode=one_step_off"],
    "async k=1": ["rollout.schedule.mode=async", "rollout.schedule.max_staleness=1"],
    "async k=2": ["rollout.schedule.mode=async", "rollout.schedule.max_staleness=2"],
    "async k=4": ["rollout.schedule.mode=async", "rollout.schedule.max_staleness=4"],
    # with the truncated rollout IS weight: decoupled PPO's correction of the stale behaviour policy (docs/async.md)
    "one_step_off + TIS": ["rollout.schedule.mode=one_step_off", "algorithm.rollout_is.mode=truncate"],
    "async k=2 + TIS": [
        "rollout.schedule.mode=async",
        "rollout.schedule.max_staleness=2",
        "algorithm.rollout_is.mode=truncate",
    ],
    # the same on pinned cores: the trainer rank on core 0, its engine on core 1 (--nproc 1 on a 2-core box)
    "sync, pinned": ["rollout.schedule.mode=sync", *PINNED],
    "one_step_off + TIS, pinned": ["rollout.schedule.mode=one_step_off", "algorithm.rollout_is.mode=truncate", *PINNED],
}
WARMUP_STEPS = 3  # left out of the step-time median


def run_schedule(name: str, args: argparse.Namespace, work: Path) -> dict:
    run_name = slug(name)
    overrides = [
        "--placement",
        "full",
        *(
            []
            if args.as_configured
            else [
                f"run.steps={args.steps}",
                f"run.eval_every={max(1, args.steps // 3)}",
                "algorithm.dynamic_sampling.enabled=false",
            ]
        ),
        "checkpoint.every=0",
        *SCHEDULES[name],
        *args.overrides,
    ]
    start = time.perf_counter()
    records = run_training(f"schedule {name!r}", args.config, args.nproc, overrides, work, run_name)
    steps = [r for r in records if r.get("step", 0) > 0 and "time/step_s" in r]
    samples = sum(r["rollout/samples"] for r in steps)
    wall = sum(r["time/step_s"] for r in steps)
    timed = [r for r in steps if r["step"] > WARMUP_STEPS]

    def fraction(parts: list[str]) -> float:
        return statistics.median(sum(r.get(p, 0.0) for p in parts) / r["time/step_s"] for r in timed)

    trained, evals = 0.0, []
    for r in records:
        trained += r.get("rollout/samples", 0.0)
        if "eval/accuracy" in r:
            evals.append({"step": r["step"], "samples": trained, "accuracy": r["eval/accuracy"]})
    return {
        "variant": name,
        "samples_per_s": samples / wall,
        "step_s": statistics.median(r["time/step_s"] for r in timed),
        "trainer_busy": fraction(["time/logprobs_s", "time/update_s", "time/sync_s"]),
        "rollout_busy": fraction(["load/rollout_busy_s"]),
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in steps),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in steps),
        "dropped_stale": sum(r.get("async/dropped_stale_samples", 0.0) for r in steps),
        "accuracy_end": evals[-1]["accuracy"],
        "evals": evals,
        "wall_s": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--as-configured",
        action="store_true",
        help="run the config's own steps, evaluations and dynamic sampling (e.g. the whole quickstart) and "
        "compare the runs' wall time, instead of --steps at equal samples",
    )
    parser.add_argument("--nproc", type=int, default=1, help="trainer ranks (each with its engine)")
    parser.add_argument("--config", type=Path, default=REPO / "configs/quickstart.yaml")
    parser.add_argument("--schedules", nargs="*", choices=list(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/async")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps: more than the {WARMUP_STEPS} warm-up steps")
    summary = lambda r: (  # noqa: E731
        f"{r['samples_per_s']:.0f} samples/s, step {r['step_s']:.3f} s, trainer busy "
        f"{r['trainer_busy']:.2f}, rollout busy {r['rollout_busy']:.2f}, accuracy {r['accuracy_end']:.3f}"
    )
    rows = harness.run_variants(
        args.schedules, lambda name, work: run_schedule(name, args, work), summary, "yatt-async-"
    )
    settings = harness.settings(args)
    commit = harness.commit()
    command = " ".join(["python benchmarks/async.py", *(shown(a) if a.startswith("/") else a for a in sys.argv[1:])])
    md = [
        f"# Rollout schedules: {shown(args.config)} {' '.join(args.overrides)}, {args.nproc} trainer rank(s) + "
        f"engine(s), {'the config’s steps' if args.as_configured else f'{args.steps} steps'}\n",
        f"{time.strftime('%Y-%m-%d')}, commit {commit.strip() or 'unknown'}: `OMP_NUM_THREADS=1 {command}`\n",
        table(
            rows,
            [
                ("samples_per_s", "samples/s"),
                ("step_s", "step s (median)"),
                ("trainer_busy", "trainer busy"),
                ("rollout_busy", "rollout busy"),
                ("staleness_mean", "staleness mean"),
                ("staleness_max", "staleness max"),
                ("dropped_stale", "dropped stale samples"),
                ("accuracy_end", "held-out acc (end)"),
                ("wall_s", "run wall s"),
            ],
            ["samples_per_s"],
        ),
        "",
        "Held-out accuracy at equal steps:" if args.as_configured else "Held-out accuracy at equal samples trained:",
        "",
        "| schedule | "
        + " | ".join(
            f"step {e['step']}" if args.as_configured else f"{e['samples']:.0f} samples" for e in rows[0]["evals"]
        )
        + " |",
        "|---|" + "---|" * len(rows[0]["evals"]),
        *(f"| {r['variant']} | " + " | ".join(f"{e['accuracy']:.3f}" for e in r["evals"]) + " |" for r in rows),
        "",
    ]
    write_results(args.out, {"settings": settings, "schedules": rows}, md)
    plt = pyplot()
    if plt is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for r in rows:
            left.plot(
                [e["samples"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], marker="o", label=r["variant"]
            )
        left.set_xlabel("samples trained")
        left.set_ylabel("held-out accuracy")
        left.legend()
        right.bar([r["variant"] for r in rows], [r["samples_per_s"] for r in rows])
        right.set_ylabel("samples/s")
        fig.tight_layout()
        fig.savefig(f"{args.out}.png", dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
