"""GPU check of the torch trainer (no vLLM needed): a train step on CUDA, then offload/onload.

    python scripts/gpu_check_trainer.py [--out DIR]
    torchrun --nproc_per_node 1 scripts/gpu_check_trainer.py --parallel fsdp2 [--out DIR]   # FSDP2 (bf16 gathers)

Checks what CPU runs cannot: that `TorchTrainer.offload()` really frees device memory (weights and
AdamW state) for another role, that `onload()` restores it, and that training resumes with the
same numbers. Prints one JSON report and exits 1 if a check fails.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from yatt.algorithms.objective import Algorithm  # noqa: E402
from yatt.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from yatt.distributed import World, close_world, init_world  # noqa: E402
from yatt.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402
from yatt.tensors import TokenBatch  # noqa: E402
from yatt.trainers.torch_config import TorchConfig  # noqa: E402
from yatt.trainers.torch_trainer import TorchTrainer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report into this folder")
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp", help="trainer.torch.parallel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    # fsdp2 shards over a process group (torchrun, NCCL): one GPU is a mesh of one, bf16 gathers, fp32 reduces
    world = (
        init_world()
        if args.parallel == "fsdp2"
        else World(rank=0, size=1, local_rank=0, device=torch.device("cuda", 0))
    )
    folder = write_tiny_model(
        Path(tempfile.mkdtemp()) / "m",
        TinyModelConfig(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4
        ),
    )
    cfg = TrainerConfig(lr=1e-4, micro_batch_size=16, torch=TorchConfig(parallel=args.parallel))
    trainer = TorchTrainer(folder, cfg, world)
    gen = torch.Generator().manual_seed(0)
    batch = TokenBatch.from_sequences(
        [torch.randint(3, 40, (32,), generator=gen).tolist() for _ in range(32)],
        [torch.randint(3, 40, (64,), generator=gen).tolist() for _ in range(32)],
        0,
    )
    old, _ = trainer.logprobs(batch)
    batch.extras.update(old_logprobs=old, advantages=torch.randn(32, generator=gen))
    loss_fn = Algorithm(AlgorithmConfig()).objective(float(batch.mask.sum()), 32.0, 64)
    first = trainer.train_mini_batch(batch, loss_fn)
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    lp_before, _ = trainer.logprobs(batch)
    off = trainer.offload()  # fsdp2: the shards move, FSDP2's modules re-register their views
    after_offload = torch.cuda.memory_allocated()
    on = trainer.onload()
    after_onload = torch.cuda.memory_allocated()
    lp_after, _ = trainer.logprobs(batch)
    second = trainer.train_mini_batch(batch, loss_fn)
    report = {
        "device": torch.cuda.get_device_name(0),
        "parallel": args.parallel,
        "sharded": trainer.sharded,
        "params": sum(p.numel() for _, p in trainer.named_weights()),
        "allocated_before_offload_mb": resident / 2**20,
        "allocated_after_offload_mb": after_offload / 2**20,
        "allocated_after_onload_mb": after_onload / 2**20,
        "offload_moved_mb": off["moved_bytes"] / 2**20,
        "onload_moved_mb": on["moved_bytes"] / 2**20,
        "logprob_max_diff_after_roundtrip": float((lp_before - lp_after).abs().max()),
        "grad_norm_first": first["grad_norm"],
        "grad_norm_second": second["grad_norm"],
    }
    report["checks"] = {
        "offload_frees_at_least_90pct": after_offload <= 0.1 * resident,
        "onload_restores": abs(after_onload - resident) <= 0.05 * resident,
        "same_logprobs_after_roundtrip": report["logprob_max_diff_after_roundtrip"] == 0.0,
        "training_continues": all(
            map(lambda x: x == x and x < float("inf"), (first["grad_norm"], second["grad_norm"]))
        ),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"gpu_check_trainer_{args.parallel}.json").write_text(text + "\n")
    close_world()
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
