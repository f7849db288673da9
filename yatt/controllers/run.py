"""A whole run: set up the shard, evaluate, step, evaluate, export the policy, write summary.json."""

from __future__ import annotations

import json
import time

import torch

from yatt.config import ExperimentConfig
from yatt.config_loading import dump_config
from yatt.controllers.metrics import MetricsLogger
from yatt.controllers.shard import ControllerShard
from yatt.distributed import World


def run_experiment(cfg: ExperimentConfig, world: World) -> dict:
    torch.set_num_threads(cfg.run.threads)
    run_dir = cfg.run.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if world.is_main:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
    world.barrier()

    wall_start = time.perf_counter()
    shard = ControllerShard(cfg, world, run_dir)
    log = MetricsLogger(run_dir / "metrics.jsonl", cfg.run.steps, enabled=world.is_main)
    try:
        start_eval = shard.evaluate()
        log.log(0, start_eval)
        train_start = time.perf_counter()
        end_eval = start_eval
        for step in range(1, cfg.run.steps + 1):
            step_start = time.perf_counter()
            metrics = shard.step(step)
            metrics["time/step_s"] = time.perf_counter() - step_start
            if step == cfg.run.steps or (cfg.run.eval_every and step % cfg.run.eval_every == 0):
                end_eval = shard.evaluate()
                metrics.update(end_eval)
            log.log(step, metrics)
        train_seconds = time.perf_counter() - train_start
        samples_trained = int(world.sum([float(shard.samples_trained)])[0])  # ranks may train different counts
        summary = {
            "steps": cfg.run.steps,
            "world_size": world.size,
            "start_accuracy": start_eval.get("eval/accuracy"),
            "end_accuracy": end_eval.get("eval/accuracy"),
            "eval_count": end_eval.get("eval/count"),
            "wall_seconds": round(time.perf_counter() - wall_start, 2),
            "train_seconds": round(train_seconds, 2),
            "samples_trained": samples_trained,
            "samples_per_second": round(samples_trained / train_seconds, 2),
        }
        if cfg.run.export_policy and world.is_main:
            shard.export_policy(run_dir / "policy")
            summary["policy_dir"] = str(run_dir / "policy")
        world.barrier()
        if world.is_main:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"done: accuracy {summary['start_accuracy']} -> {summary['end_accuracy']} in "
                  f"{summary['wall_seconds']:.0f}s; run dir {run_dir}", flush=True)
        return summary
    finally:
        log.close()
        shard.close()
