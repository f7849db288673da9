"""`benchmarks/checkpoint.py --megatron`: the training stall of a save of a megatron-split policy, without and
with checkpoint.export_hf, side by side in one run.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/checkpoint.py --megatron --tp 2 [--pp 1]
        [--saves 3] [--hidden 768] [--layers 12] [--out benchmarks/results/checkpoint_megatron.json]

Every rank builds a MegatronTrainer on the random Qwen2 of checkpoint.py (rank 0 writes it), takes one Adam
step (so optimizer state exists), then saves through the run's own path: yatt's Checkpointer, the controller
shard's export hook (yatt.checkpoint.export.policy_writer), the background writer and its commit. Saves
alternate between two checkpoint roots, one without and one with export_hf, so both see the same machine
load; after each save a training step runs while the writer writes, as in a run. The stall of a save is the
slowest rank's (the next collective waits for it): a host snapshot of the rank's shard, plus, with the export,
the gather of the whole policy into a host copy on rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from yatt.checkpoint.checkpointer import Checkpointer
from yatt.checkpoint.export import policy_writer
from yatt.config import load_experiment
from yatt.controllers.fingerprint import config_fingerprint
from yatt.distributed import init_world
from yatt.models.tiny import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
MODES = ("state only", "state + export_hf")


class TrainerState:
    """A run's checkpoint state around a sharded trainer (yatt.checkpoint.checkpointer.Stateful)."""

    replicated: tuple[str, ...] = ()

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"trainer": self.trainer.state_dict(), "progress": {"step": self.trainer.optimizer_steps}}


def shard_bytes(state: dict) -> int:
    """Bytes of the tensors in a (nested) state dict: what this rank's snapshot copies."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(shard_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(shard_bytes(v) for v in state)
    return 0


def run(args: argparse.Namespace, random_qwen2, train_step) -> int:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    world = init_world()
    tmp = tempfile.TemporaryDirectory(prefix="yatt-ckpt-mcore-") if world.is_main else None
    work = Path(world.broadcast_object(tmp.name if tmp else None))
    name = f"qwen2-h{args.hidden}x{args.layers}"
    if world.is_main:
        write_tiny_model(work / name, random_qwen2(args.hidden, args.layers), seed=0)
    world.barrier()
    model = work / name
    split = [f"trainer.megatron.tensor_parallel={args.tp}", f"trainer.megatron.pipeline_parallel={args.pp}"]
    base = [f"model.path={model}", "trainer.backend=megatron", "trainer.micro_batch_size=4", *split]
    checkpoints = {}
    for i, mode in enumerate(MODES):
        root = f"checkpoint.dir={work / f'ck{i}'}"
        cfg = load_experiment(
            REPO / "configs/quickstart.yaml",
            [*base, f"run.output_dir={work}", root, f"checkpoint.export_hf={mode != MODES[0]}"],
        )
        fingerprint = config_fingerprint(cfg)
        checkpoints[mode] = Checkpointer(cfg.checkpoint, cfg.run.run_dir, fingerprint, world)
    from yatt.trainers.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(model, cfg.trainer, world, total_steps=100)
    train_step(trainer)  # Adam state exists from here on
    state, tokenizer = TrainerState(trainer), AutoTokenizer.from_pretrained(model)
    hook = partial(policy_writer, trainer, key="trainer", tokenizer=tokenizer)  # as ControllerShard's
    stalls: dict[str, list[float]] = {m: [] for m in MODES}
    after: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.saves):
        for mode, ck in checkpoints.items():
            world.barrier()
            stall = ck.save(i + 1, state, hook)
            stalls[mode].append(float(world.max([stall])[0]))
            start = time.perf_counter()
            train_step(trainer)  # training goes on while the writer runs
            ck.finish()
            after[mode].append(float(world.max([time.perf_counter() - start])[0]))
    alone = statistics.mean(train_step(trainer) for _ in range(2))
    params = sum(p.numel() for p in trainer.gpt.parameters())
    largest = int(world.max([float(shard_bytes(trainer.state_dict()))])[0])  # PP stages may differ
    if world.is_main:
        last = checkpoints[MODES[1]].root / f"step-{args.saves:08d}" / "policy" / "model.safetensors"
        result = {
            "model": name,
            "tensor_parallel": args.tp,
            "pipeline_parallel": args.pp,
            "ranks": world.size,
            "params_rank0": params,
            "shard_bytes_rank0": shard_bytes(trainer.state_dict()),
            "shard_bytes_max": largest,
            "export_bytes": last.stat().st_size,
            "train_step_alone_s": alone,
            **{
                mode: {
                    "stall_s": [round(s, 4) for s in stalls[mode]],
                    "stall_mean_s": statistics.mean(stalls[mode]),
                    "stall_median_s": statistics.median(stalls[mode]),
                    "step_and_write_after_stall_s": statistics.mean(after[mode]),
                }
                for mode in MODES
            },
        }
        result["export_over_state_only"] = result[MODES[1]]["stall_mean_s"] / result[MODES[0]]["stall_mean_s"]
        print(f"\n{name}, TP={args.tp} PP={args.pp} on {world.size} ranks, {args.saves} saves per mode")
        print(f"{'mode':<18} {'stall mean s':>13} {'median s':>9} {'step + write after s':>21}")
        for mode in MODES:
            r = result[mode]
            print(
                f"{mode:<18} {r['stall_mean_s']:>13.3f} {r['stall_median_s']:>9.3f} "
                f"{r['step_and_write_after_stall_s']:>21.3f}"
            )
        print(
            f"export/state-only stall: {result['export_over_state_only']:.2f}; rank 0's shard state "
            f"{result['shard_bytes_rank0'] / 2**20:.1f} MB, export {result['export_bytes'] / 2**20:.1f} MB; "
            f"a training step alone {alone:.3f} s"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": [result]}, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    world.barrier()
    if tmp is not None:
        tmp.cleanup()
    return 0
