"""Training stall per checkpoint save: asynchronous (host snapshot + background writer) vs synchronous.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint.py [--out benchmarks/results/checkpoint.json] [--saves 3]
        [--hidden 768] [--layers 12]
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/checkpoint.py --megatron --tp 2 [--pp 1] [--saves 3]

The megatron mode (benchmarks/checkpoint_megatron.py) measures a split policy's save stall without and with
checkpoint.export_hf side by side; the rest of this page is the one-process torch comparison.

For the quickstart policy and a 100M+ parameter Qwen2 (built here, random weights; --hidden/--layers shrink it),
a one-process TorchTrainer takes one AdamW step (so optimizer state exists), then saves its state `--saves` times
each way through the same snapshot + CheckpointWriter path a run uses. The stall is how long the
training thread is blocked by a save: the host snapshot for async, snapshot + write + fsync +
checksums + commit for sync. The ratio is of mean stalls (medians are in the JSON too). For async it
also reports how long the background write took after the stall, and a training step's time alone vs
while a write runs (the cost of sharing the CPU with the writer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from yatt.checkpoint.snapshot import snapshot  # noqa: E402
from yatt.checkpoint.writer import CheckpointWriter, SaveJob  # noqa: E402
from yatt.config import TrainerConfig  # noqa: E402
from yatt.distributed import World  # noqa: E402
from yatt.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402
from yatt.tensors import TokenBatch  # noqa: E402
from yatt.trainers.torch_trainer import TorchTrainer  # noqa: E402


def random_qwen2(hidden: int, layers: int) -> TinyModelConfig:
    """The random Qwen2 of the second workload: 12 query / 4 key-value heads (hidden 768, 12 layers: 100M+)."""
    return TinyModelConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
    )


def loss(logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: TokenBatch) -> tuple[torch.Tensor, dict]:
    """Any loss that reaches every weight (yatt.tensors.LossFn): what is timed is the step, not what it learns."""
    return -(logprobs * mb.mask).sum() / mb.mask.sum() * 1e-3, {}


def train_step(trainer: TorchTrainer) -> float:
    start = time.perf_counter()
    batch = TokenBatch.from_sequences([[5, 6, 7, 8] * 4] * 4, [[9, 10, 11, 2] * 4] * 4, pad_id=0)
    trainer.train_mini_batch(batch, loss)
    return time.perf_counter() - start


def bench_model(name: str, path: Path, saves: int, work: Path) -> dict:
    world = World(0, 1, 0, torch.device("cpu"))
    trainer = TorchTrainer(path, TrainerConfig(micro_batch_size=4), world, total_steps=100)
    train_step(trainer)  # AdamW state exists from here on
    params = sum(p.numel() for p in trainer.module.parameters())
    result: dict = {"model": name, "params": params}
    for mode in ("sync", "async"):
        writer = CheckpointWriter(work / f"{name}-{mode}", 0, 1, token=mode, keep=2, async_write=mode == "async")
        writer.root.mkdir(parents=True)
        stalls, background, steps_during = [], [], []
        for i in range(saves):
            start = time.perf_counter()
            snap = snapshot({"trainer": trainer.state_dict()})
            writer.submit(SaveJob(i + 1, {"shared": snap}))
            stalls.append(time.perf_counter() - start)
            if mode == "async":
                steps_during.append(train_step(trainer))  # training goes on while the writer runs
            start = time.perf_counter()
            writer.wait()
            background.append(time.perf_counter() - start + (steps_during[-1] if steps_during else 0.0))
        result[mode] = {
            "stall_s": [round(s, 4) for s in stalls],
            "stall_mean_s": statistics.mean(stalls),
            "stall_median_s": statistics.median(stalls),
        }
        if mode == "async":
            result[mode]["write_after_stall_s"] = statistics.mean(background)
            result[mode]["train_step_during_write_s"] = statistics.mean(steps_during)
        result["state_bytes"] = snap.nbytes
    result["train_step_alone_s"] = statistics.mean(train_step(trainer) for _ in range(2))
    result["async_over_sync"] = result["async"]["stall_mean_s"] / result["sync"]["stall_mean_s"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint.json"))
    parser.add_argument("--saves", type=int, default=3, help="saves per mode for the 100M model")
    parser.add_argument("--saves-small", type=int, default=10, help="saves per mode for the quickstart model")
    parser.add_argument(
        "--quickstart",
        type=Path,
        default=Path("models/quickstart-policy"),
        help="the quickstart policy's folder (skipped when missing)",
    )
    parser.add_argument("--hidden", type=int, default=768, help="the random Qwen2's hidden size (a multiple of 12)")
    parser.add_argument("--layers", type=int, default=12, help="the random Qwen2's layers")
    parser.add_argument(
        "--megatron",
        action="store_true",
        help="under torchrun: a megatron-split policy's save stall without and with checkpoint.export_hf "
        "(benchmarks/checkpoint_megatron.py)",
    )
    parser.add_argument("--tp", type=int, default=2, help="--megatron: tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="--megatron: pipeline parallel size")
    args = parser.parse_args()
    if args.megatron:
        from checkpoint_megatron import run  # noqa: PLC0415  (needs megatron-core; only this mode imports it)

        if args.out == parser.get_default("out"):
            args.out = args.out.with_name("checkpoint_megatron.json")
        return run(args, random_qwen2, train_step)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="yatt-ckpt-bench-") as tmp:
        work = Path(tmp)
        models = [("quickstart", args.quickstart, args.saves_small)] if args.quickstart.is_dir() else []
        big = "qwen2-100m" if (args.hidden, args.layers) == (768, 12) else f"qwen2-h{args.hidden}x{args.layers}"
        models.append((big, write_tiny_model(work / big, random_qwen2(args.hidden, args.layers), seed=0), args.saves))
        for name, path, saves in models:
            results.append(bench_model(name, path, saves, work))
            print(f"{name}: done", flush=True)
    print(
        f"\n{'model':<12} {'params':>12} {'state MB':>9} {'sync stall s':>13} {'async stall s':>14} "
        f"{'async/sync':>11} {'bg write s':>11} {'step alone/during write s':>27}"
    )
    for r in results:
        a = r["async"]
        print(
            f"{r['model']:<12} {r['params']:>12,} {r['state_bytes'] / 2**20:>9.1f} "
            f"{r['sync']['stall_mean_s']:>13.3f} "
            f"{a['stall_mean_s']:>14.3f} {r['async_over_sync']:>11.3f} {a['write_after_stall_s']:>11.3f} "
            f"{r['train_step_alone_s']:>13.3f} / {a['train_step_during_write_s']:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
