"""LoRA (model.lora) against full training, side by side on one workload: step time, weight-sync time, trainer
memory, checkpoint size and held-out accuracy.

    OMP_NUM_THREADS=1 python benchmarks/lora.py [--steps 60] [--nproc 2] [--rank 16] [--lora-lr-scale 10]
        [--variants NAME ...] [--config configs/smollm2_arith.yaml] [--out benchmarks/results/lora] [OVERRIDE ...]

OVERRIDEs (`a.b=c`) go to every run. Variants (each a real run of `launch/train.py --nproc <nproc>`, one after
the other, never two at once, on the same data and seeds):
- full: the config as it is (its engines: vLLM for the SmolLM2 config);
- LoRA: model.lora.rank=<rank> on every linear layer of the decoder, merged syncs (the adapted layers only);
- LoRA adapter sync: the same sending only the adapters (model.lora.sync=adapter), which the vLLM engines serve
  with vLLM's LoRA layers beside the unchanged base weights;
- full (hf), LoRA merged sync (hf) and LoRA adapter sync (hf): the same on hf engines, the last sending only the
  adapters, which the engine merges into its own copy of the base weights.
LoRA rows train at --lora-lr-scale x the config's trainer.lr ("LoRA Without Regret": LoRA's best learning rate is
about 10x full training's).

Per variant: the median step, update and sync times (time/step_s, time/update_s, time/sync_s) over the steps after
the first --warmup, the MiB one sync sends each engine (counted from the policy's trainer, built once here), the
trainer processes' peak RSS (perf/peak_rss_gib, the largest rank), the size of the checkpoint written after the
last step (its trainer and controller state, not checkpoint.export_hf's folder), and held-out accuracy at the
start and the end. Ratios are to the first variant; the hf rows compare with full (hf).

Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import harness
from harness import run_training, shown, slug, table, write_results

REPO = Path(__file__).resolve().parents[1]
HF = ["rollout.engine.backend=hf", "rollout.engine.vllm=null"]
VARIANTS = {  # name: (overrides, is LoRA)
    "full": ([], False),
    "LoRA": ([], True),
    "LoRA adapter sync": (["model.lora.sync=adapter"], True),
    "full (hf)": (HF, False),
    "LoRA merged sync (hf)": (HF, True),
    "LoRA adapter sync (hf)": ([*HF, "model.lora.sync=adapter"], True),
}


def checkpoint_bytes(folder: Path) -> int:
    """The files of one checkpoint but its exported policy folder."""
    return sum(
        f.stat().st_size for f in folder.rglob("*") if f.is_file() and "policy" not in f.relative_to(folder).parts
    )


def sync_mib(config: Path, overrides: list[str]) -> float:
    """MiB one weight sync sends the engine (in the engine's dtype, as its client casts them), counted from the
    policy's trainer built here in one process before the run (nothing is timed)."""
    import torch

    from yatt.config import load_experiment
    from yatt.distributed import World
    from yatt.tensors import DTYPES
    from yatt.trainers.torch_trainer import TorchTrainer

    cfg = load_experiment(config, overrides)
    world = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
    trainer = TorchTrainer(cfg.model.path, cfg.trainer, world, lora=cfg.model.lora if cfg.model.lora.enabled else None)
    engine = DTYPES[cfg.rollout.engine.dtype]
    sent = [t for bucket in trainer.engine_weights(1 << 40) for _, t in bucket]
    cast = lambda t: engine.itemsize if t.is_floating_point() and t.dtype != torch.float64 else t.element_size()
    return sum(t.numel() * cast(t) for t in sent) / 2**20


def run_variant(name: str, args: argparse.Namespace, lr: float, work: Path) -> dict:
    run_name = slug(name)
    overrides, lora = VARIANTS[name]
    if lora:
        overrides = [*overrides, f"model.lora.rank={args.rank}", f"trainer.lr={lr * args.lora_lr_scale}"]
    sent_mib = sync_mib(args.config, [*overrides, *args.overrides])
    settings = [
        f"run.steps={args.steps}",
        f"run.eval_every={max(1, args.steps // 6)}",
        f"checkpoint.every={args.steps}",
        "checkpoint.export_hf=false",
        "checkpoint.async_write=false",
        *overrides,
        *args.overrides,
    ]
    start = time.perf_counter()
    records = run_training(f"variant {name!r}", args.config, args.nproc, settings, work, run_name)
    steps = [r for r in records if r.get("step", 0) > 0 and "time/step_s" in r]
    timed = [r for r in steps if r["step"] > args.warmup] or steps
    evals = [{"step": r["step"], "accuracy": r["eval/accuracy"]} for r in records if "eval/accuracy" in r]
    return {
        "variant": name,
        "step_s": statistics.median(r["time/step_s"] for r in timed),
        "update_s": statistics.median(r["time/update_s"] for r in timed),
        "sync_s": statistics.median(r["time/sync_s"] for r in timed),
        "sync_mib": sent_mib,
        "peak_rss_gib": max(r["perf/peak_rss_gib"] for r in steps),
        "checkpoint_mib": checkpoint_bytes(work / run_name / "checkpoints" / f"step-{args.steps:08d}") / 2**20,
        "accuracy_start": evals[0]["accuracy"] if evals else float("nan"),
        "accuracy_end": evals[-1]["accuracy"] if evals else float("nan"),
        "evals": evals,
        "wall_s": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the time medians")
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (each with its engine)")
    parser.add_argument("--rank", type=int, default=16, help="model.lora.rank of the LoRA variants")
    parser.add_argument("--lora-lr-scale", type=float, default=10.0, help="LoRA lr = this x the config's lr")
    parser.add_argument("--config", type=Path, default=REPO / "configs/smollm2_arith.yaml")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/lora")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from yatt.config import load_experiment

    lr = load_experiment(args.config, args.overrides).trainer.lr
    summary = lambda r: (  # noqa: E731
        f"step {r['step_s']:.2f} s, update {r['update_s']:.2f} s, sync {r['sync_s']:.3f} s "
        f"({r['sync_mib']:.1f} MiB), peak RSS "
        f"{r['peak_rss_gib']:.2f} GiB, checkpoint {r['checkpoint_mib']:.1f} MiB, accuracy "
        f"{r['accuracy_start']:.3f} -> {r['accuracy_end']:.3f}"
    )
    rows = harness.run_variants(
        args.variants, lambda name, work: run_variant(name, args, lr, work), summary, "yatt-lora-"
    )
    settings = harness.settings(args)
    commit = harness.commit()
    command = shlex.join(
        ["python", "benchmarks/lora.py", *(shown(a) if a.startswith("/") else a for a in sys.argv[1:])]
    )
    columns = [
        ("step_s", "step s"),
        ("update_s", "update s"),
        ("sync_s", "sync s"),
        ("sync_mib", "sync MiB"),
        ("peak_rss_gib", "peak RSS GiB"),
        ("checkpoint_mib", "checkpoint MiB"),
        ("accuracy_start", "acc start"),
        ("accuracy_end", "acc end"),
    ]
    ratios = ["step_s", "update_s", "sync_s", "sync_mib", "peak_rss_gib", "checkpoint_mib"]
    by_engine = [[r for r in rows if "(hf)" not in r["variant"]], [r for r in rows if "(hf)" in r["variant"]]]
    md = [
        f"# LoRA r={args.rank} against full training: {shown(args.config)} {' '.join(args.overrides)}, "
        f"{args.nproc} ranks, {args.steps} steps (medians after {args.warmup})\n",
        f"{time.strftime('%Y-%m-%d')}, commit {commit.strip() or 'unknown'}: `OMP_NUM_THREADS=1 {command}`\n",
        *(table(group, columns, ratios) + "\n" for group in by_engine if group),
        "Held-out accuracy by step:",
        "",
        "| variant | " + " | ".join(f"step {e['step']}" for e in rows[0]["evals"]) + " |",
        "|---|" + "---|" * len(rows[0]["evals"]),
        *(f"| {r['variant']} | " + " | ".join(f"{e['accuracy']:.3f}" for e in r["evals"]) + " |" for r in rows),
        "",
    ]
    write_results(args.out, {"settings": settings, "variants": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
