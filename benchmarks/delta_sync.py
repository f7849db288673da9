"""Which tensors of a weight sync a training step leaves bit for bit unchanged, per kind of policy yatt trains.

    OMP_NUM_THREADS=1 python benchmarks/delta_sync.py [--steps 3] [--out benchmarks/results/delta_sync]

The delta sync (rollout.engine.delta_sync, yatt/engines/delta.py) leaves out of a sync what an engine holds at the
trainer's current version. Where can it pay? Per case, the real torch trainer (AdamW, grad clip 1, lr 3e-4 cosine
as the quickstarts, two optimizer steps per RL step as their mini_batches: 2) trains a tiny policy of that kind on
random sequences with a REINFORCE-style loss (random +-1 advantage per sequence), and after each RL step the
tensors the sync would send (`engine_weights`: the frozen parts already left out) are compared with the previous
sync's copy: the bytes an exact detector would find unchanged ("unchanged"), against the bytes the trainer's
version tracking leaves out (`weight_versions` + `HeldWeights`, whole units: "left out"). A last row per case is a
step the policy does not train (PPO's critic warm-up: critic.warmup_steps). Sizes are float32 bytes.

Cases: the quickstart's Qwen2 (full fine-tune), the MoE quickstart's Qwen3-MoE (8 experts, top-2; HF keeps a
layer's experts in one tensor), LoRA with merged syncs on [q_proj, v_proj] and on all-linear, LoRA with adapter
syncs. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
import harness  # noqa: E402 (this folder is on sys.path: `python benchmarks/X.py`)
import torch  # noqa: E402

from yatt.distributed import World  # noqa: E402
from yatt.engines.delta import HeldWeights  # noqa: E402
from yatt.models.lora_config import LoRAConfig  # noqa: E402
from yatt.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402
from yatt.tensors import TokenBatch  # noqa: E402
from yatt.trainers.config import TrainerConfig  # noqa: E402
from yatt.trainers.torch_trainer import TorchTrainer  # noqa: E402

CASES = {
    "qwen2 full": (TinyModelConfig(), None),
    "qwen3-moe full": (TinyModelConfig(architecture="qwen3_moe"), None),
    "lora merged q,v": (TinyModelConfig(), LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])),
    "lora merged all-linear": (TinyModelConfig(), LoRAConfig(rank=8, alpha=16)),
    "lora adapter all-linear": (TinyModelConfig(), LoRAConfig(rank=8, alpha=16, sync="adapter")),
}


def batch(vocab: int, rows: int, gen: torch.Generator) -> TokenBatch:
    prompts = [torch.randint(3, vocab, (8,), generator=gen).tolist() for _ in range(rows)]
    responses = [torch.randint(3, vocab, (8,), generator=gen).tolist() for _ in range(rows)]
    b = TokenBatch.from_sequences(prompts, responses, pad_id=0)
    adv = (torch.randint(0, 2, (rows, 1), generator=gen).float() * 2 - 1).expand_as(b.mask)
    b.extras["advantages"] = adv.contiguous()
    return b


def loss_fn(logp, entropy, mb):
    tokens = mb.mask.sum().clamp(min=1)
    return -(logp * mb.extras["advantages"] * mb.mask).sum() / tokens, {}


def compressed_difference(now: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, float]:
    """Issue 42's optional compressed difference, measured: the float32 tensors' lossless difference (their bits
    XOR the previous sync's) compressed by zlib at its fastest level; its size as a fraction of the raw bytes, and
    zlib's MB/s next to a plain copy's (what a shm sync does with each byte), in the same process."""
    raw = b"".join(
        (now[n].contiguous().view(torch.int32) ^ before[n].contiguous().view(torch.int32)).numpy().tobytes()
        for n in now
        if now[n].dtype == torch.float32
    )
    start = time.perf_counter()
    packed = zlib.compress(raw, 1)
    zlib_s = time.perf_counter() - start
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    start = time.perf_counter()
    buf.clone()
    copy_s = time.perf_counter() - start
    mb = len(raw) / 2**20
    return {"diff_packed_frac": len(packed) / max(1, len(raw)), "zlib_mb_s": mb / zlib_s, "copy_mb_s": mb / copy_s}


def measure(name: str, model_cfg: TinyModelConfig, lora: LoRAConfig | None, steps: int, tmp: Path) -> list[dict]:
    path = write_tiny_model(tmp / name.replace(" ", "_"), model_cfg, seed=0)
    cfg = TrainerConfig(lr=3e-4, lr_schedule="cosine", min_lr_ratio=0.2, micro_batch_size=64)
    world = World(0, 1, 0, torch.device("cpu"))
    trainer = TorchTrainer(path, cfg, world, total_steps=2 * steps, **({"lora": lora} if lora else {}))
    vocab = trainer.hf_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def synced() -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for b in trainer.engine_weights(1 << 30) for n, t in b}

    held = HeldWeights()
    before = synced()
    versions = trainer.weight_versions()
    held.acknowledged(list(before), versions)
    rows = []
    for step in range(1, steps + 2):
        trains = step <= steps  # the last step: no policy update (a critic warm-up step)
        if trains:
            for _ in range(2):  # mini_batches: 2
                trainer.train_mini_batch(batch(vocab, 64, gen), loss_fn)
        now, versions = synced(), trainer.weight_versions()
        size = {n: t.numel() * t.element_size() for n, t in now.items()}
        unchanged = {n for n in now if torch.equal(now[n], before[n])}
        left_out = held.held(list(now.items()), versions)
        assert left_out <= unchanged, f"{name}: left out a changed tensor: {sorted(left_out - unchanged)[:3]}"
        rows.append(
            {
                "case": name,
                "step": step,
                "trains": trains,
                "tensors": len(now),
                "mb": sum(size.values()) / 2**20,
                "unchanged_tensors": len(unchanged),
                "unchanged_mb": sum(size[n] for n in unchanged) / 2**20,
                "left_out_tensors": len(left_out),
                "left_out_mb": sum(size[n] for n in left_out) / 2**20,
                "unchanged_names": sorted(unchanged)[:8],
                **compressed_difference(now, before),
            }
        )
        held.acknowledged(list(now), versions)
        before = now
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/delta_sync")
    args = parser.parse_args()
    torch.manual_seed(0)
    commit = harness.commit()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model_cfg, lora) in CASES.items():
            rows += measure(name, model_cfg, lora, args.steps, Path(tmp))
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
    command = f"OMP_NUM_THREADS=1 python benchmarks/delta_sync.py --steps {args.steps}"
    meta = {"date": date.today().isoformat(), "commit": commit.strip(), "command": command, "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Delta sync: what a training step leaves unchanged of what the weight sync sends",
        "",
        f"{meta['date']}, commit {meta['commit']}: `{command}` (JSON: [delta_sync.json](delta_sync.json)).",
        "Per RL step (2 AdamW steps; the last row of a case: no policy update, as in PPO's critic warm-up), the "
        "tensors the sync sends, those bit for bit equal to the previous sync's (an exact detector's skip), and those "
        "the trainer's versions leave out (the delta sync's skip).",
        "",
        "| case | step | policy trained | sync MB | tensors | unchanged MB (tensors) | left out MB (tensors) "
        "| difference zlib'd to | zlib MB/s | copy MB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['step']} | {'yes' if r['trains'] else 'no'} | {r['mb']:.3f} | {r['tensors']} | "
            f"{r['unchanged_mb']:.3f} ({r['unchanged_tensors']}) | {r['left_out_mb']:.3f} ({r['left_out_tensors']}) | "
            f"{r['diff_packed_frac']:.2f} | {r['zlib_mb_s']:.0f} | {r['copy_mb_s']:.0f} |"
        )
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
