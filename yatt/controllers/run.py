"""A whole run: set up the shard (or resume it), evaluate, step, save checkpoints, export, summarise."""

from __future__ import annotations

import json
import resource
import signal
import time

import torch
from transformers import AutoTokenizer

from yatt.checkpoint.checkpointer import Checkpointer, PreemptionFlag
from yatt.config import ExperimentConfig
from yatt.config_loading import dump_config
from yatt.controllers.components import build_components
from yatt.controllers.metrics import MetricsLogger, keep_metrics_until
from yatt.controllers.samples import SamplesWriter, keep_samples_until
from yatt.controllers.sinks import open_sinks
from yatt.controllers.shard import ControllerShard
from yatt.data.prepare import load_rank_data
from yatt.distributed import World, data_parallel_world


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
        print(f"run {run_dir} already finished at step {start_step}: accuracy {summary.get('start_accuracy')} -> "
              f"{summary.get('end_accuracy')}; raise run.steps to continue it, or --resume none to start it over",
              flush=True)
    return world.broadcast_object(summary)


def run_experiment(cfg: ExperimentConfig, world: World, resume: str = "auto") -> dict:
    """resume: none | auto | PATH (see yatt.checkpoint.resume)."""
    torch.set_num_threads(cfg.run.threads)
    run_dir = cfg.run.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpointer(cfg, world)
    found = checkpoints.find(resume)
    start_step = found[1] if found else 0
    if finished := _finished_summary(run_dir, start_step, cfg.run.steps, world):
        return finished
    history: list[dict] = []
    if world.is_main:
        if found:
            history = keep_metrics_until(run_dir / "metrics.jsonl", start_step)
            keep_samples_until(run_dir / "samples.jsonl", start_step)
            print(f"resuming from {found[0]} (step {start_step})", flush=True)
        else:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            (run_dir / "samples.jsonl").unlink(missing_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
    checkpoints.discard_newer(start_step)

    wall_start = time.perf_counter()
    if world.is_main:
        print(f"world: {world.size} rank(s) on {world.device.type}, process group backend {world.backend}", flush=True)
    # the data is read and every prompt tokenized before any engine starts: a bad row stops the run here
    # with tensor/pipeline parallelism the ranks of one model-parallel group share one data-parallel slice
    data_world = data_parallel_world(world, *cfg.trainer.model_parallel)
    data = load_rank_data(cfg, data_world, AutoTokenizer.from_pretrained(str(cfg.model.path)))
    shard = ControllerShard(cfg, world, build_components(cfg, world, run_dir), data, data_world=data_world)
    if found:
        checkpoints.load(found[0], shard)
    samples_before = shard.samples_trained
    sinks = open_sinks(cfg.run, cfg.model_dump(mode="json")) if world.is_main else []
    log = MetricsLogger(run_dir / "metrics.jsonl", cfg.run.steps, enabled=world.is_main, sinks=sinks)
    samples = SamplesWriter(run_dir / "samples.jsonl", cfg.run.samples, enabled=world.is_main)

    def evaluate(step: int) -> dict:
        if world.is_main and cfg.data.eval is not None:
            print(f"eval at step {step}: greedy responses to up to {cfg.data.eval_prompts} held-out prompts", flush=True)
        result = shard.evaluate()
        samples.write(step, shard.last_eval, shard.last_rollouts)
        return result

    preemption = PreemptionFlag()
    try:
        if found:
            start_eval, end_eval = _evals(history)
        else:
            start_eval = end_eval = evaluate(0)
            log.log(0, start_eval)
        train_start = time.perf_counter()
        for step in range(start_step + 1, cfg.run.steps + 1):
            step_start = time.perf_counter()
            metrics = shard.step(step)
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
                checkpoints.save(step, shard, shard.export_checkpoint)
            if signum:
                folder = checkpoints.finish()
                if world.is_main:
                    print(f"received {signal.Signals(signum).name} at step {step}: checkpoint written to "
                          f"{folder}; resume with --resume auto", flush=True)
                return {"preempted_at_step": step, "checkpoint": str(folder)}
        checkpoints.finish()
        train_seconds = time.perf_counter() - train_start
        # ranks may train different counts (dynamic sampling, rebalancing)
        samples, since_start = data_world.sum([float(shard.samples_trained),
                                               float(shard.samples_trained - samples_before)])
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
            print(f"done: accuracy {summary['start_accuracy']} -> {summary['end_accuracy']} in "
                  f"{summary['wall_seconds']:.0f}s; run dir {run_dir}", flush=True)
        return summary
    finally:
        preemption.restore()
        log.close()
        shard.close()
