"""A whole run: check its inputs, ready the run directory, set up the shard (or resume it), evaluate, step, save
checkpoints, export, summarise.

The order is the operator's safety: every input is checked, reading only, before anything in the run directory
changes. The config and the files it names are checked by the launcher (yatt.launcher); here, on every rank, this
rank's data rows and images, then the checkpoint to resume and its config, then whether `--resume none` may start
the run over. Only then does rank 0 touch the run directory, and what this launch replaces (an earlier run's
checkpoints and record, or an abandoned timeline's) is set aside, not deleted, until this launch commits: its first
complete checkpoint, or, when it saves none, its end (yatt.checkpoint.aside).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import time
from functools import partial
from pathlib import Path

import torch

from yatt.checkpoint.aside import drop_aside, set_aside
from yatt.checkpoint.checkpointer import Checkpointer, PreemptionFlag
from yatt.config import ExperimentConfig
from yatt.config_loading import dump_config
from yatt.controllers.components import build_components
from yatt.controllers.fingerprint import config_fingerprint
from yatt.controllers.metrics import MetricsLogger, keep_metrics_until
from yatt.controllers.samples import SamplesWriter, keep_samples_until
from yatt.controllers.shard import ControllerShard
from yatt.controllers.sinks import open_sinks
from yatt.data.prepare import load_rank_data
from yatt.distributed import World, data_parallel_world, model_parallel_world
from yatt.models.tokenizer import load_tokenizer

UNSPLIT_ENV = "YATT_UNSPLIT_GENERATION"
# what a run writes into its directory and a fresh start replaces (logs/ and the run secret stay)
RECORD = ("metrics.jsonl", "samples.jsonl", "summary.json", "config.yaml", "policy", "tensorboard")


def _evals(records: list[dict]) -> tuple[dict, dict]:
    """Start and latest eval metrics of the logged history (a resumed run does not redo them)."""
    evals = [{k: v for k, v in r.items() if k.startswith("eval/")} for r in records if "eval/accuracy" in r]
    return (evals[0], evals[-1]) if evals else ({}, {})


def _finished_summary(run_dir, start_step: int, steps: int, world: World) -> dict | None:
    """The summary of a run that already reached its last step (rerunning the same command resumes by
    default), so it is reported as it is instead of being overwritten by an empty rerun."""
    summary = None
    path = run_dir / "summary.json"
    if world.is_main and start_step >= steps and path.is_file():
        summary = json.loads(path.read_text())
        print(
            f"run {run_dir} already finished at step {start_step}: accuracy {summary.get('start_accuracy')} -> "
            f"{summary.get('end_accuracy')}; raise run.steps to continue it, or --resume none --overwrite to start "
            "it over",
            flush=True,
        )
    return world.broadcast_object(summary)


def _open_run_dir(
    cfg: ExperimentConfig, world: World, checkpoints: Checkpointer, found: tuple[Path, int] | None
) -> list[dict]:
    """Rank 0 readies the run directory for this launch (every input is checked by now); the logged history up to
    the resume step (empty when starting over). Every rank returns once the directory is ready."""
    history: list[dict] = []
    run_dir = cfg.run.run_dir
    if world.is_main:
        start_step = found[1] if found else 0
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cut = checkpoints.replace_newer(start_step)
        if found:  # the record is cut back to the resume step; an abandoned timeline's whole record is kept aside
            aside = set_aside(run_dir, move=[], copy=["metrics.jsonl", "samples.jsonl"] if cut else [])
            history = keep_metrics_until(run_dir / "metrics.jsonl", start_step)
            keep_samples_until(run_dir / "samples.jsonl", start_step)
            print(f"resuming from {found[0]} (step {start_step})", flush=True)
        else:
            aside = set_aside(run_dir, move=RECORD)
        if cut or aside:
            print(
                f"replacing an earlier run's files: kept in {' and '.join(str(a) for a in (cut, aside) if a)} "
                "until this run's first checkpoint commits (or, saving none, it ends)",
                flush=True,
            )
        dump_config(cfg, run_dir / "config.yaml")
    world.barrier()
    return history


def run_experiment(cfg: ExperimentConfig, world: World, resume: str = "auto", overwrite: bool = False) -> dict:
    """resume: none | auto | PATH (see yatt.checkpoint.resume); overwrite: let `none` start over a run that has
    checkpoints (see the module docstring for what is checked when)."""
    torch.set_num_threads(cfg.run.threads)
    if cfg.run.cores:  # the engines this rank spawns set their own (rollout.engine.cores)
        os.sched_setaffinity(0, cfg.run.cores)
    run_dir = cfg.run.run_dir
    wall_start = time.perf_counter()
    # 1. the inputs, reading only. The data first, so a bad row is reported as itself whatever the resume mode,
    # and before any engine starts (every prompt is tokenized). With tensor/pipeline parallelism the ranks of one
    # model-parallel group share one data-parallel slice.
    data_world = data_parallel_world(world, *cfg.trainer.model_parallel)
    data = load_rank_data(cfg.data, data_world, load_tokenizer(cfg.model.path), cfg.reward.verifiers)
    fingerprint = config_fingerprint(cfg)
    checkpoints = Checkpointer(cfg.checkpoint, run_dir, fingerprint, world, on_commit=partial(drop_aside, run_dir))
    found = checkpoints.find(resume, overwrite)  # verified, config-compatible; `none` over checkpoints needs overwrite
    start_step = found[1] if found else 0
    if finished := _finished_summary(run_dir, start_step, cfg.run.steps, world):
        return finished
    # 2. the run directory changes from here on
    history = _open_run_dir(cfg, world, checkpoints, found)
    if world.is_main:
        print(f"world: {world.size} rank(s) on {world.device.type}, process group backend {world.backend}", flush=True)
    # the ranks of one model-parallel group split its generation; YATT_UNSPLIT_GENERATION=1 has each generate all
    # of it (the same batch, the way to check the split)
    group = None if os.environ.get(UNSPLIT_ENV) else model_parallel_world(world, *cfg.trainer.model_parallel)
    parts = build_components(cfg, world, run_dir)
    shard = ControllerShard(cfg, world, parts, data, data_world=data_world, group_world=group)
    if found:
        checkpoints.load(found[0], shard.checkpoint)
    trained_before = trained = shard.progress.samples_trained  # this rank's, since the run began (a resume restores it)
    latest: list = []  # the last step's rollouts
    sinks = open_sinks(cfg.run, cfg.model_dump(mode="json")) if world.is_main else []
    resumed = (start_step, history[-1]["elapsed_s"] if history else 0.0)
    log = MetricsLogger(run_dir / "metrics.jsonl", cfg.run.steps, enabled=world.is_main, sinks=sinks, resumed=resumed)
    samples = SamplesWriter(run_dir / "samples.jsonl", cfg.run.samples, enabled=world.is_main)

    def evaluate(step: int) -> dict:
        if world.is_main and cfg.data.eval is not None:
            print(
                f"eval at step {step}: greedy responses to up to {cfg.data.eval_prompts} held-out prompts", flush=True
            )
        result, rollouts = shard.evaluate()
        samples.write(step, rollouts, latest)
        return result

    preemption = PreemptionFlag()
    step_gc = cfg.run.gc == "step"
    if step_gc:  # what set-up made is never scanned again; the loop collects at each step's start, on every rank
        gc.collect()
        gc.freeze()
        gc.disable()
    try:
        if found:
            start_eval, end_eval = _evals(history)
        else:
            start_eval = end_eval = evaluate(0)
            log.log(0, start_eval)
        train_start = time.perf_counter()
        for step in range(start_step + 1, cfg.run.steps + 1):
            step_start = time.perf_counter()
            if step_gc:
                gc.collect()
            result = shard.step(step)
            metrics, latest = result.metrics, result.rollouts
            trained = result.samples_trained
            metrics["time/step_s"] = time.perf_counter() - step_start
            # peak resident memory of a controller+trainer process (engines are separate processes)
            metrics["perf/peak_rss_gib"] = world.max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])[0]
            if step == cfg.run.steps or (cfg.run.eval_every and step % cfg.run.eval_every == 0):
                end_eval = evaluate(step)
                metrics.update(end_eval)
            log.log(step, metrics)
            # The cheapest point to save: after the weight sync, before the next generation.
            signum = preemption.agreed(world)
            if signum or checkpoints.due(step):
                checkpoints.save(step, shard.checkpoint, shard.export_checkpoint)
            if signum:
                folder = checkpoints.finish()
                if world.is_main:
                    print(
                        f"received {signal.Signals(signum).name} at step {step}: checkpoint written to "
                        f"{folder}; resume with --resume auto",
                        flush=True,
                    )
                return {"preempted_at_step": step, "checkpoint": str(folder)}
        checkpoints.finish()
        train_seconds = time.perf_counter() - train_start
        # ranks may train different counts (dynamic sampling, rebalancing)
        samples, since_start = data_world.sum([float(trained), float(trained - trained_before)])
        summary = {
            "steps": cfg.run.steps,
            "world_size": world.size,
            "resumed_from_step": start_step,
            "start_accuracy": start_eval.get("eval/accuracy"),
            "end_accuracy": end_eval.get("eval/accuracy"),
            "start_score": start_eval.get("eval/score"),
            "end_score": end_eval.get("eval/score"),
            "eval_count": end_eval.get("eval/count"),
            "wall_seconds": round(time.perf_counter() - wall_start, 2),
            "train_seconds": round(train_seconds, 2),
            "samples_trained": int(samples),
            "samples_per_second": round(since_start / train_seconds, 2),
            "checkpoint_stall_seconds": round(sum(checkpoints.stall_seconds), 3),
        }
        # a sharded trainer gathers its shards for the export: every rank takes part, rank 0 writes
        if cfg.run.export_policy and (world.is_main or not shard.trainer.replicated):
            shard.export_policy(run_dir / "policy")
            summary["policy_dir"] = str(run_dir / "policy")
        world.barrier()
        if world.is_main:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            checkpoints.committed()  # a run that saved no checkpoint commits here
            print(
                f"done: accuracy {summary['start_accuracy']} -> {summary['end_accuracy']} in "
                f"{summary['wall_seconds']:.0f}s"
                + (f" (this launch, resumed from step {start_step})" if start_step else "")
                + f"; run dir {run_dir}",
                flush=True,
            )
        return summary
    finally:
        if step_gc:
            gc.enable()
            gc.unfreeze()
        preemption.restore()
        log.close()
        shard.close()
