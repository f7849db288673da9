"""Trainer backends side by side: torch (DDP) vs torch FSDP2 vs megatron TP=2 vs megatron PP=2 on 2 CPU ranks.

    OMP_NUM_THREADS=1 python benchmarks/trainers.py [--hidden 768] [--layers 12] [--heads 12] [--kv-heads 4]
        [--intermediate 2048] [--vocab 32768] [--samples 32] [--steps 3] [--dtype float32]
        [--variants NAME ...] [--model-folder FOLDER] [--out benchmarks/results/trainers]

    # DDP against FSDP2 on SmolLM2-135M (docs/smollm2.md converts it), 5 timed steps:
    OMP_NUM_THREADS=1 python benchmarks/trainers.py --model-folder models/smollm2-135m-instruct \
        --variants torch "torch FSDP2" --steps 5 --out benchmarks/results/trainers_fsdp2

Model: a Qwen2 with random weights (seed 0, tied embeddings, q/k/v biases), written to a temporary folder. The
default shape has 100.7M parameters: 12 layers, hidden 768, 12 query / 4 key-value heads, MLP 2048, a
32,768-token vocabulary. Heads and key-value heads must divide by 2 (TP=2), layers by 2 (PP=2); run it small
with e.g. `--hidden 256 --layers 4 --intermediate 768 --heads 4 --kv-heads 2`.

`--model-folder FOLDER` takes a Hugging Face folder instead (e.g. SmolLM2-135M; its 9 heads rule out TP=2).

Variants, one after the other (never at once), each a torchrun job of 2 ranks building its trainer through the
registry as a run does (`yatt.trainers.TRAINERS[trainer.backend](model, TrainerConfig, world)`), with the
default trainer settings and lr 1e-5: `torch` (DDP: each rank the whole model and AdamW state, half the
samples), `torch FSDP2` (trainer.torch.parallel=fsdp2: each rank half of every weight, gradient and moment,
half the samples), `megatron TP=2` (every layer and the vocabulary split over the 2 ranks; one data-parallel rank),
`megatron PP=2` (half the layers per stage, the first stage with the embedding, the last with a copy of it as
the tied output head; one data-parallel rank). Each step trains the same global batch of --samples samples
(seed 1000: prompts of 32-96 tokens, responses of 64-128, random advantages), split by data-parallel rank, so
torch's ranks take 16 each and the megatron ranks all 32 (a TP/PP group trains on one data-parallel rank's
samples).

Per variant:
- step time: a log-prob pass (the old log-probs) + one optimizer step with the PPO-clip objective, which is
  what a step's logprobs and update stages run; each rank's mean over --steps steps after one warm-up step,
  the slower rank's reported.
- state memory per rank: the bytes of parameters + gradients + optimizer state that the rank holds, counted
  from its tensors right after each optimizer step (a torch.optim step hook: the moment all three exist;
  the peak over steps). Counted: the model's parameters; their gradients (torch: `.grad`, views into DDP's
  all-reduce buckets; megatron: `.main_grad`, views into DDP's float32 gradient buffer); every tensor of the
  torch optimizer(s) stepping them: the parameters they update (megatron's distributed optimizer: this rank's
  slices of its master weights, float32 copies with a bfloat16 model, views of the parameters with a float32
  one), their gradients and their state (AdamW exp_avg, exp_avg_sq, step). Each tensor's whole storage is
  counted once, so views into megatron's contiguous parameter/gradient buffers (and their padding) count as
  the buffers they live in, tied weights once. Activations, the scorer's temporaries and allocator caches are
  not counted; they are in the peak RSS.
- peak RSS per rank (VmHWM at the end): everything the process touched, a secondary figure.
- agreement: the first log-prob pass (before any update) against torch's, max |dlogp| over response tokens,
  and every step's gradient norm and policy loss (summed over ranks) against the first variant's, max relative
  difference: the same batch and loss contract should give the same numbers.

Prints the table and the ratios of TP=2's and FSDP2's per-rank state to torch's (acceptance: <= 0.6 and
<= 0.55; exits 1 above them), and FSDP2's step time to torch's (acceptance <= 1.3, reported); writes
<out>.json (everything) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import add_worker_args, rank_result, run_worker, shown, slug, table, vm_kib, write_results

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {  # name: trainer settings besides the defaults
    "torch": {"backend": "torch"},
    "torch FSDP2": {"backend": "torch", "torch": {"parallel": "fsdp2"}},
    "megatron TP=2": {"backend": "megatron", "megatron": {"tensor_parallel": 2}},
    "megatron PP=2": {"backend": "megatron", "megatron": {"pipeline_parallel": 2}},
}
TP_STATE_BAR = 0.6  # TP=2 holds about half of the torch backend's per-rank state; the acceptance bar
FSDP2_STATE_BAR, FSDP2_STEP_BAR = 0.55, 1.3  # FSDP2 at 2 ranks: about half the state, at most 30% slower
MIB = 2**20


def write_model(folder: Path, args: argparse.Namespace) -> int:
    """A random-weight Qwen2 of the requested shape as a Hugging Face folder; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def parameter_count(folder: Path) -> int:
    """Parameters of a Hugging Face folder's safetensors files (tied weights stored once)."""
    from safetensors import safe_open

    count = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                count += math.prod(shape)
    return count


def global_batch(vocab: int, samples: int, seed: int = 1000):
    """The step's samples, the same for every variant and rank: prompts of 32-96 tokens, responses of 64-128,
    a random advantage each."""
    import torch

    from yatt.tensors import TokenBatch

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))] for _ in range(samples)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 128))] for _ in range(samples)]
    batch = TokenBatch.from_sequences(prompts, responses, pad_id=0)
    batch.extras["advantages"] = torch.tensor([rng.uniform(-1, 1) for _ in prompts])
    return batch


class StateMeter:
    """Bytes of parameters, gradients and optimizer state this process holds, measured after every torch
    optimizer step (see the module docstring for what is counted); `peak` is the largest total seen."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.module = None  # the trainer's model, set once it is built
        self.optimizers: list = []  # every torch optimizer that stepped (megatron may chain several)
        self.peak: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
        self._hook = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        held = self.held()
        if held["total"] > self.peak["total"]:
            self.peak = held

    def held(self) -> dict[str, int]:
        import torch

        from yatt.trainers.sharding import local  # FSDP2's DTensors: the rank's own shard is what it holds

        params = list(self.module.parameters())
        groups = {
            "params": params,
            "grads": [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None],
            "optimizer": [
                t
                for opt in self.optimizers
                for group in opt.param_groups
                for p in group["params"]
                for t in (p, p.grad, *opt.state.get(p, {}).values())
                if torch.is_tensor(t)
            ],
        }
        seen: set[int] = set()  # storages already counted: a view adds nothing to the buffer it lives in
        held = {}
        for kind, tensors in groups.items():
            held[kind] = 0
            for t in map(local, tensors):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    held[kind] += storage.nbytes()
        held["total"] = sum(held.values())
        return held


def worker(args: argparse.Namespace) -> None:
    """One variant on this rank: build the trainer, time --steps steps after a warm-up, write the results."""
    import torch

    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig, TrainerConfig
    from yatt.distributed import data_parallel_world, init_world
    from yatt.trainers import TRAINERS

    torch.set_num_threads(1)
    world = init_world()
    cfg = TrainerConfig(lr=1e-5, dtype=args.dtype, **json.loads(args.trainer))
    meter = StateMeter()
    trainer = TRAINERS.get(cfg.backend)(args.model, cfg, world, total_steps=args.steps + 1)
    meter.module = trainer.model
    data = data_parallel_world(world, *cfg.model_parallel)
    rows = list(range(data.rank, args.samples, data.size))
    batch = global_batch(trainer.hf_config.vocab_size, args.samples).select(rows)
    algorithm = Algorithm(AlgorithmConfig())
    times, first, curve = [], {}, []
    for step in range(args.steps + 1):
        world.barrier()
        start = time.perf_counter()
        batch.extras["old_logprobs"] = trainer.logprobs(batch)[0]
        middle = time.perf_counter()
        # the loss contract of both backends: global denominators over the data-parallel size; 128 is the
        # longest response (the length that length-normalised aggregations divide by)
        tokens, seqs = data.sum([float(batch.mask.sum()), float(len(batch))])
        stats = trainer.train_mini_batch(batch, algorithm.objective(tokens / data.size, seqs / data.size, 128))
        end = time.perf_counter()
        curve.append({"grad_norm": stats["grad_norm"], "policy_loss": data.sum([stats["policy_loss"]])[0]})
        if step:  # step 0 warms up
            times.append((middle - start, end - middle))
        else:
            first = {
                "grad_norm": stats["grad_norm"],
                "logprobs": {
                    r: batch.extras["old_logprobs"][i][batch.mask[i].bool()].tolist() for i, r in enumerate(rows)
                },
            }
    out = {
        "rank": world.rank,
        "logprobs_s": statistics.mean(t[0] for t in times),
        "update_s": statistics.mean(t[1] for t in times),
        "state_bytes": meter.peak,
        "peak_rss_gib": vm_kib(os.getpid(), "VmHWM") / 2**20,
        "curve": curve,
        **first,
    }
    rank_result(args.result, world.rank).write_text(json.dumps(out))


def run_variant(name: str, settings: dict, model: Path, args: argparse.Namespace, work: Path) -> dict:
    start = time.perf_counter()
    ranks = run_worker(
        name,
        Path(__file__),
        [
            "--model",
            str(model),
            "--trainer",
            json.dumps(settings),
            "--steps",
            str(args.steps),
            "--samples",
            str(args.samples),
            "--dtype",
            args.dtype,
        ],
        work / slug(name),
        REPO,
    )
    logprobs = {int(r): v for rank in ranks for r, v in rank["logprobs"].items()}
    return {
        "variant": name,
        "logprobs_s": max(r["logprobs_s"] for r in ranks),
        "update_s": max(r["update_s"] for r in ranks),
        "step_s": max(r["logprobs_s"] + r["update_s"] for r in ranks),
        "state_mib": max(r["state_bytes"]["total"] for r in ranks) / MIB,
        "state_mib_per_rank": [r["state_bytes"]["total"] / MIB for r in ranks],
        "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
        "peak_rss_gib": max(r["peak_rss_gib"] for r in ranks),
        "peak_rss_gib_per_rank": [r["peak_rss_gib"] for r in ranks],
        "grad_norm_first": ranks[0]["grad_norm"],
        "curve": ranks[0]["curve"],
        "wall_s": time.perf_counter() - start,
        "_logprobs": logprobs,
    }


def agreement(rows: list[dict]) -> None:
    """Each variant's first log-probs against the first variant's: max |dlogp| over every response token."""
    reference, curve = rows[0]["_logprobs"], rows[0]["curve"]
    for r in rows:
        mine = r.pop("_logprobs")
        r["logprob_diff_max"] = max(abs(a - b) for i, ref in reference.items() for a, b in zip(mine[i], ref))
        r["curve_rel_diff_max"] = max(
            abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for a, b in zip(r["curve"], curve) for k in b
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32_768)
    parser.add_argument("--samples", type=int, default=32, help="samples per step, over all ranks")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="trainer.dtype")
    parser.add_argument(
        "--variants",
        nargs="*",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="the first is the reference of ratios and agreement",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/trainers")
    parser.add_argument("--model-folder", dest="folder", type=Path, help="a Hugging Face folder instead of --hidden...")
    add_worker_args(parser, "--model", "--trainer")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    megatron = any(name.startswith("megatron") for name in args.variants)
    if megatron and (args.heads % 2 or args.kv_heads % 2 or args.layers % 2):
        parser.error("TP=2 and PP=2 need --heads, --kv-heads and --layers divisible by 2")
    if args.steps < 1:
        parser.error("--steps: at least one timed step")
    hidden = ("worker", "model", "trainer", "result")  # the worker's flags
    paths = {"out": shown(args.out), "folder": args.folder and shown(args.folder)}  # no machine paths in results
    results: dict = {"settings": {k: v for k, v in vars(args).items() if k not in hidden} | paths}
    with tempfile.TemporaryDirectory(prefix="yatt-trainers-") as tmp:
        work = Path(tmp)
        if args.folder is not None:
            os.symlink(args.folder.resolve(), work / "model")
            results["params"] = parameter_count(work / "model")
        else:
            results["params"] = write_model(work / "model", args)
        print(f"model: {results['params'] / 1e6:.1f}M parameters, {args.samples} samples per step", flush=True)
        rows = []
        for name in args.variants:
            print(f"{name} ...", flush=True)
            rows.append(run_variant(name, VARIANTS[name], work / "model", args, work))
            print(
                f"  step {rows[-1]['step_s']:.2f} s, state {rows[-1]['state_mib']:.1f} MiB/rank, "
                f"peak RSS {rows[-1]['peak_rss_gib']:.2f} GiB/rank",
                flush=True,
            )
    agreement(rows)
    results["variants"] = rows
    md = [
        f"# Trainer backends: {results['params'] / 1e6:.1f}M-parameter "
        f"{shown(args.folder) if args.folder else 'Qwen2'}, 2 CPU ranks (gloo), "
        f"{args.samples} samples per step, {args.dtype}\n",
        table(
            rows,
            [
                ("logprobs_s", "logprobs s"),
                ("update_s", "update s"),
                ("step_s", "step s"),
                ("state_mib", "state MiB/rank"),
                ("peak_rss_gib", "peak RSS GiB/rank"),
                ("grad_norm_first", "grad norm 1st"),
                ("logprob_diff_max", "max |dlogp|"),
                ("curve_rel_diff_max", "max rel diff loss/gnorm"),
            ],
            ["step_s", "state_mib"],
        ),
        "",
    ]
    ok = True
    by_name = {r["variant"]: r for r in rows}
    if {"torch", "megatron TP=2"} <= set(by_name):
        ratio = by_name["megatron TP=2"]["state_mib"] / by_name["torch"]["state_mib"]
        ok = ratio <= TP_STATE_BAR
        results["tp2_state_ratio"] = ratio
        md.append(
            f"TP=2 / torch per-rank state (params + grads + optimizer): {ratio:.3f} "
            f"(acceptance <= {TP_STATE_BAR}: {'pass' if ok else 'FAIL'})\n"
        )
    if {"torch", "torch FSDP2"} <= set(by_name):
        state = by_name["torch FSDP2"]["state_mib"] / by_name["torch"]["state_mib"]
        step = by_name["torch FSDP2"]["step_s"] / by_name["torch"]["step_s"]
        results.update(fsdp2_state_ratio=state, fsdp2_step_ratio=step)
        ok = ok and state <= FSDP2_STATE_BAR
        md.append(
            f"FSDP2 / torch per-rank state: {state:.3f} (acceptance <= {FSDP2_STATE_BAR}: "
            f"{'pass' if state <= FSDP2_STATE_BAR else 'FAIL'}); step time: {step:.2f}x (acceptance <= "
            f"{FSDP2_STEP_BAR}: {'pass' if step <= FSDP2_STEP_BAR else 'FAIL'}); loss and grad norm over "
            f"{args.steps + 1} steps within {by_name['torch FSDP2']['curve_rel_diff_max']:.1e} (relative)\n"
        )
    write_results(args.out, results, md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
