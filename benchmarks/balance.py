"""DP load balancing on a skewed, long-tailed length distribution: workload imbalance and trainer step time.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/balance.py [--reps 3] \
        [--out benchmarks/results/balance.json]

Each rank holds 8 GRPO groups of 8 synthetic rollouts. Response lengths are long-tailed (log-normal per
group, as prompt difficulty makes whole groups long) and skewed: rank 0's prompts are harder, so its
responses are about 3x longer. The same batch is trained three ways, interleaved, on one tiny Qwen2:
  none       no rebalancing, micro-batches of 16 sequences (today's default)
  balance    Karmarkar-Karp over whole groups, then the same count-based micro-batches
  balance+   balance, then token-budget micro-batches (trainer.micro_batch_tokens)
Step time = rebalance exchange + one optimizer step (forward, backward, DDP all-reduce, AdamW) over
the rank's batch, the part balancing affects; the slowest rank sets it, so it is the max over ranks.
"""

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from yatt.algorithms.objective import Algorithm  # noqa: E402
from yatt.balance.exchange import rebalance  # noqa: E402
from yatt.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from yatt.data.rollout import Rollout  # noqa: E402
from yatt.distributed import close_world, init_world  # noqa: E402
from yatt.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402
from yatt.tensors import TokenBatch  # noqa: E402
from yatt.trainers.torch_trainer import TorchTrainer  # noqa: E402

GROUPS, G, HIDDEN, MAX_LEN = 8, 8, 128, 384
SETUPS = {"none": (False, 0), "balance": (True, 0), "balance+": (True, 4096)}


def synthetic_rollouts(rank: int, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed * 100 + rank)
    scale = 90.0 if rank == 0 else 30.0  # the skew: rank 0 drew the hard prompts
    out = []
    for _ in range(GROUPS):
        prompt = [rng.randrange(3, 20) for _ in range(rng.randrange(8, 24))]
        base = scale * math.exp(rng.gauss(0.0, 0.6))  # long tail over groups
        for _ in range(G):
            n = max(1, min(MAX_LEN - len(prompt), int(base * math.exp(rng.gauss(0.0, 0.3)))))
            out.append(
                Rollout(
                    None,
                    prompt,
                    [rng.randrange(3, 20) for _ in range(n)],
                    [-rng.random() for _ in range(n)],
                    "stop",
                    reward=float(rng.random() < 0.5),
                    origin=(rank, len(out)),
                )
            )
    return out


def train_step(trainer: TorchTrainer, world, samples: list[Rollout], balance: bool, attention_coef: float):
    """Rebalance (or not), then one optimizer step; returns (seconds, plan)."""
    world.barrier()
    start = time.perf_counter()
    held, plan = rebalance(world, samples, unit_size=G, attention_coef=attention_coef, enabled=balance)
    batch = TokenBatch.from_sequences([s.prompt_ids for s in held], [s.response_ids for s in held], pad_id=0)
    batch.extras["old_logprobs"] = batch.per_token([s.rollout_logprobs for s in held])
    batch.extras["advantages"] = torch.tensor([s.reward - 0.5 for s in held])
    tokens, seqs = world.sum([float(batch.mask.sum()), float(len(batch))])
    trainer.train_mini_batch(
        batch, Algorithm(AlgorithmConfig()).objective(tokens / world.size, seqs / world.size, norm_length=MAX_LEN)
    )
    return time.perf_counter() - start, plan


def measure(world, args: argparse.Namespace) -> None:
    model_dir = Path(args.workdir) / "model"
    if world.is_main:
        write_tiny_model(
            model_dir,
            TinyModelConfig(
                hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=2, max_position_embeddings=MAX_LEN
            ),
        )
    world.barrier()
    attention_coef = 1.0 / (6 * HIDDEN)  # attention ~ 2*L*h per token vs ~12*h^2 for the projections
    trainer = TorchTrainer(model_dir, TrainerConfig(lr=1e-6), world)
    samples = synthetic_rollouts(world.rank)
    times: dict[str, list[float]] = {name: [] for name in SETUPS}
    plans = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for name, (balance, budget) in SETUPS.items():
            trainer.cfg = TrainerConfig(lr=1e-6, micro_batch_size=16, micro_batch_tokens=budget)
            seconds, plans[name] = train_step(trainer, world, samples, balance, attention_coef)
            if rep:
                times[name].append(world.max([seconds])[0])
    rows = []
    for name in SETUPS:
        m = plans[name].metrics()
        rows.append(
            {
                "setup": name,
                "imbalance": round(m["balance/imbalance_after"], 4),
                "moved_samples": int(m["balance/moved_samples"]),
                "step_s_median": round(statistics.median(times[name]), 4),
                "step_s_all": [round(t, 4) for t in times[name]],
            }
        )
    base = rows[0]["step_s_median"]
    for row in rows:
        row["speedup"] = round(base / row["step_s_median"], 3)
    if world.is_main:
        print(f"{'setup':<10} {'max/mean workload':>18} {'moved':>6} {'step s (median)':>16} {'speedup':>8}")
        for r in rows:
            print(
                f"{r['setup']:<10} {r['imbalance']:>18.3f} {r['moved_samples']:>6d} {r['step_s_median']:>16.3f} "
                f"{r['speedup']:>8.2f}"
            )
        result = {
            "world_size": world.size,
            "groups_per_rank": GROUPS,
            "group_size": G,
            "hidden_size": HIDDEN,
            "attention_coef": attention_coef,
            "reps": args.reps,
            "tokens_per_rank_before": [
                sum(len(s.prompt_ids) + len(s.response_ids) for s in synthetic_rollouts(r)) for r in range(world.size)
            ],
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/balance.json")
    parser.add_argument("--workdir", default="runs/bench_balance")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = init_world()
    try:  # the trainer (and its DDP reducer) is gone before the process group: destroying it after can hang
        measure(world, args)
        world.barrier()
    finally:
        close_world()


if __name__ == "__main__":
    main()
