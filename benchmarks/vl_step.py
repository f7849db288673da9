"""A vision-language training step per rank: pixels and the vision tower once per prompt vs once per sample.

    OMP_NUM_THREADS=1 python benchmarks/vl_step.py --baseline-code ../vl-base [--prompts 512] [--image-size 448]
        [--group-size 8] [--response-tokens 256] [--steps 3] [--nproc 2] [--variants today packed ...]
        [--out benchmarks/results/vl_step]

Why: before, the trainer's batch gave each of a prompt's G samples its own copy of the prompt's pixels
(`stack_pixels`, with an int64 pixel_attention_mask: 8 bytes a pixel), the vision tower encoded every copy, and VL
rows took the padded path. At the controller-memory benchmark's size (benchmarks/controller_memory.py: 512
prompts of one 448-pixel image, G = 8, 256-token responses, 2 ranks) that is ~7.8 GiB of pixels per rank. Now the
batch holds each prompt's pixels once (a bool mask), the tower encodes each distinct prompt once per micro-batch,
and VL rows pack with shared prompts. Acceptance: the batch's pixel bytes <= 1/G of today's, step time <= 0.6x.

Workload (benchmarks/image_workload.py, in a temporary folder): --prompts textured JPEGs of --image-size squared
pixels, one per prompt, and a VL policy from yatt.models.tiny_vl (patch 14, pixel shuffle 4: 64 image tokens at
448, random weights) whose real Idefics3 processor keeps the images at full size. Each rank reads its shard of the
rows and encodes its images with yatt's own code (read_jsonl_shard, encode_prompts, load_batch_images), makes G
rollouts per prompt sharing the prompt's PromptImages (as generation does) with --response-tokens random tokens
each (seeded by prompt: every variant trains the same samples), and builds the trainer's batch with
`yatt.controllers.policy.token_batch`, the step's own code.

Variants, one after the other, each a torchrun job of --nproc ranks with the default trainer settings (lr 1e-5):
- today: the same worker importing yatt from --baseline-code, a checkout of the commit before this change (e.g.
  `git worktree add ../vl-base <commit>`); the results record its commit, not its path.
- padded: this checkout with trainer.pack_sequences=false (pixels and the tower once per prompt, padded rows).
- packed: this checkout, the defaults (packed rows, shared prompts): the new path.

Per variant, per rank (the tables give the largest rank):
- pixel bytes: the bytes of the trainer batch's pixel tensors (TokenBatch.pixels), and those of the rollouts'
  PromptImages, shared by a prompt's samples in every variant.
- step time: a log-prob pass (the old log-probs) + one optimizer step with the PPO-clip objective, the median
  over --steps steps after one warm-up step.
- peak memory: host, VmHWM above the RSS at the moment the trainer and the rollouts are ready (reset there; it
  covers building the batch and the steps); on a GPU also the device's peak allocated bytes over the steps.
- agreement: the first log-prob pass against the first variant's, max |dlogp| over response tokens.

Writes <out>.json and <out>.md; exits 1 when `packed` misses a bar against `today`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import add_worker_args, rank_result, run_worker, shown, slug, table, vm_kib, write_results
from proc_memory import reset_peak

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {  # name: (code: "baseline" or "this", trainer settings besides the defaults)
    "today": ("baseline", {}),
    "padded": ("this", {"pack_sequences": False}),
    "packed": ("this", {}),
}
PIXEL_BAR, TIME_BAR = 1.0, 0.6  # pixel bytes <= 1/G of today's; step time <= 0.6x today's
MIB = 2**20


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rank_rollouts(args: argparse.Namespace, world):
    """This rank's rollouts: G per prompt of its shard, sharing the prompt's PromptImages, seeded by prompt."""
    import random

    from transformers import AutoTokenizer

    from yatt.controllers.images import load_batch_images
    from yatt.data.jsonl import read_jsonl_shard
    from yatt.data.prepare import encode_prompts
    from yatt.data.rollout import Rollout
    from yatt.models.vision import ImageInputs

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = read_jsonl_shard([Path(args.data) / "train.jsonl"], world.rank, world.size)
    images = load_batch_images(rows, ImageInputs(args.model), encode_prompts(rows, tok, 256))
    letters = tok("abcdefghijklmnopqrstuvwxyz0123456789", add_special_tokens=False).input_ids
    rollouts = []
    for row, im in zip(rows, images):
        rng = random.Random(row.index)
        for _ in range(args.group_size):
            response = [rng.choice(letters) for _ in range(args.response_tokens)]
            rollouts.append(Rollout(row, im.prompt_ids, response, [0.0] * len(response), "length", vision=im))
    return rollouts, images, tok.pad_token_id


def worker(args: argparse.Namespace) -> None:
    """One variant on this rank: the trainer, the rollouts, then --steps timed steps after a warm-up."""
    import torch

    import yatt
    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig, TrainerConfig
    from yatt.controllers.policy import token_batch
    from yatt.distributed import init_world
    from yatt.trainers import TRAINERS

    torch.set_num_threads(1)
    world = init_world()
    cfg = TrainerConfig(lr=1e-5, **json.loads(args.trainer))
    trainer = TRAINERS.get(cfg.backend)(args.model, cfg, world, total_steps=args.steps + 1)
    rollouts, images, pad_id = rank_rollouts(args, world)
    cuda = world.device.type == "cuda"
    idle_kib = vm_kib(os.getpid(), "VmRSS")
    reset_peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats(world.device)
    device_idle = torch.cuda.memory_allocated(world.device) if cuda else 0
    batch = token_batch(rollouts, pad_id, 1.0)
    gen = torch.Generator().manual_seed(1000 + world.rank)
    batch.extras["advantages"] = torch.rand(len(batch), generator=gen) * 2 - 1
    algorithm = Algorithm(AlgorithmConfig())
    tokens, seqs = world.sum([float(batch.mask.sum()), float(len(batch))])
    times, first = [], None
    for step in range(args.steps + 1):
        world.barrier()
        start = time.perf_counter()
        batch.extras["old_logprobs"] = trainer.logprobs(batch)[0]
        middle = time.perf_counter()
        trainer.train_mini_batch(
            batch, algorithm.objective(tokens / world.size, seqs / world.size, args.response_tokens)
        )
        end = time.perf_counter()
        if step:
            times.append((middle - start, end - middle))
        else:
            first = batch.extras["old_logprobs"][batch.mask.bool()].clone()
    torch.save(first, rank_result(args.result, world.rank, ".pt"))
    out = {
        "rank": world.rank,
        "yatt": str(Path(yatt.__file__).resolve().parents[1]),  # checked by the driver, not recorded
        "samples": len(batch),
        "prompts": len(images),
        "batch_pixel_bytes": tensor_bytes(batch.pixels.values()),
        "batch_pixel_dtypes": {k: str(v.dtype) for k, v in batch.pixels.items()},
        "rollout_pixel_bytes": tensor_bytes(t for im in images for t in im.pixels.values()),
        "logprobs_s": statistics.median(t[0] for t in times),
        "update_s": statistics.median(t[1] for t in times),
        "step_s": statistics.median(t[0] + t[1] for t in times),
        "peak_host_mib": (vm_kib(os.getpid(), "VmHWM") - idle_kib) / 1024,
        "peak_device_mib": (torch.cuda.max_memory_allocated(world.device) - device_idle) / MIB if cuda else 0.0,
        "device": world.device.type,
    }
    rank_result(args.result, world.rank).write_text(json.dumps(out))


def run_variant(name: str, args: argparse.Namespace, work: Path) -> dict:
    which, settings = VARIANTS[name]
    code = args.baseline_code.resolve() if which == "baseline" else REPO
    start = time.perf_counter()
    worker_args = ["--model", str(work / "policy"), "--data", str(work / "data"), "--trainer", json.dumps(settings)]
    worker_args += ["--steps", str(args.steps), "--group-size", str(args.group_size)]
    worker_args += ["--response-tokens", str(args.response_tokens)]
    result = work / slug(name)
    ranks = run_worker(name, Path(__file__), worker_args, result, code, args.nproc)
    if any(Path(r["yatt"]) != code for r in ranks):
        raise RuntimeError(f"variant {name!r} imported yatt from elsewhere than its code folder")
    import torch

    return {
        "variant": name,
        "code": which,
        "trainer": settings,
        "samples_per_rank": [r["samples"] for r in ranks],
        "batch_pixel_mib": max(r["batch_pixel_bytes"] for r in ranks) / MIB,
        "batch_pixel_bytes_per_rank": [r["batch_pixel_bytes"] for r in ranks],
        "batch_pixel_dtypes": ranks[0]["batch_pixel_dtypes"],
        "rollout_pixel_mib": max(r["rollout_pixel_bytes"] for r in ranks) / MIB,
        "logprobs_s": max(r["logprobs_s"] for r in ranks),
        "update_s": max(r["update_s"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "step_s_per_rank": [r["step_s"] for r in ranks],
        "peak_host_mib": max(r["peak_host_mib"] for r in ranks),
        "peak_host_mib_per_rank": [r["peak_host_mib"] for r in ranks],
        "peak_device_mib": max(r["peak_device_mib"] for r in ranks),
        "device": ranks[0]["device"],
        "wall_s": time.perf_counter() - start,
        "_logprobs": [torch.load(rank_result(result, r, ".pt")) for r in range(args.nproc)],
    }


def agreement(rows: list[dict]) -> None:
    """Each variant's first log-probs against the first variant's: max |dlogp| over every response token."""
    reference = rows[0]["_logprobs"]
    for r in rows:
        mine = r.pop("_logprobs")
        r["logprob_diff_max"] = max(float((a - b).abs().max()) if len(a) else 0.0 for a, b in zip(mine, reference))


def command(args: argparse.Namespace) -> str:
    """The command line as the results show it: the baseline checkout named by a placeholder, not its path."""
    argv = [a if a != str(args.baseline_code) else "<baseline checkout>" for a in sys.argv[1:]]
    return shlex.join(["python", "benchmarks/vl_step.py", *(shown(a) if a.startswith("/") else a for a in argv)])


def commit_of(folder: Path) -> str:
    """The checkout's commit (and '+changes' when its tree differs from it), for the results."""
    git = ["git", "-C", str(folder)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return (commit or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=512, help="image prompts per step, over all ranks")
    parser.add_argument("--image-size", type=int, default=448, help="image side in pixels (a multiple of 56)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun processes)")
    parser.add_argument(
        "--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS), help="the first is the reference"
    )
    parser.add_argument("--baseline-code", type=Path, help="a checkout of the commit before this change (today)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/vl_step")
    add_worker_args(parser, "--model", "--data", "--trainer")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if "today" in args.variants and (args.baseline_code is None or not (args.baseline_code / "yatt").is_dir()):
        parser.error("--baseline-code: a checkout of the commit before this change (the 'today' variant runs it)")
    if args.steps < 1:
        parser.error("--steps: at least one timed step")
    sys.path.insert(0, str(REPO))  # the workload writers import this checkout's yatt
    from image_workload import write_policy, write_workload

    hidden = ("worker", "model", "data", "trainer", "result", "baseline_code")  # the worker's flags, a path
    results: dict = {
        "settings": {k: v for k, v in vars(args).items() if k not in hidden} | {"out": shown(args.out)},
        "code": {"this": commit_of(REPO)},
    }
    if args.baseline_code is not None:
        results["code"]["baseline"] = commit_of(args.baseline_code)
    with tempfile.TemporaryDirectory(prefix="yatt-vl-step-") as tmp:
        work = Path(tmp)
        results["workload"] = write_workload(work / "data", args.prompts, args.image_size)
        write_policy(work / "policy", args.image_size)
        print(f"{args.prompts} prompts x G={args.group_size}, {args.image_size} px, {args.nproc} ranks", flush=True)
        rows = []
        for name in args.variants:
            print(f"{name} ...", flush=True)
            rows.append(run_variant(name, args, work))
            r = rows[-1]
            print(
                f"  step {r['step_s']:.2f} s, batch pixels {r['batch_pixel_mib']:.1f} MiB/rank, "
                f"peak host {r['peak_host_mib']:.0f} MiB/rank",
                flush=True,
            )
    agreement(rows)
    results["variants"] = rows
    md = [
        f"# VL step: {args.prompts} prompts x one {args.image_size}-px image, G = {args.group_size}, "
        f"{args.response_tokens}-token responses, {args.nproc} ranks ({rows[0]['device']})\n",
        f"{time.strftime('%Y-%m-%d')}, commit {results['code']['this'][:7]} (today: "
        f"{results['code'].get('baseline', 'not run')[:7]}): `OMP_NUM_THREADS=1 {command(args)}`\n",
        table(
            rows,
            [
                ("batch_pixel_mib", "batch pixels MiB/rank"),
                ("rollout_pixel_mib", "rollout pixels MiB/rank"),
                ("peak_host_mib", "peak host MiB/rank"),
                ("peak_device_mib", "peak device MiB/rank"),
                ("logprobs_s", "logprobs s"),
                ("update_s", "update s"),
                ("step_s", "step s"),
                ("logprob_diff_max", "max abs dlogp"),
            ],
            ["batch_pixel_mib", "peak_host_mib", "step_s"],
        ),
        "",
    ]
    ok = True
    by_name = {r["variant"]: r for r in rows}
    if {"today", "packed"} <= set(by_name):
        today, new = by_name["today"], by_name["packed"]
        pixels = new["batch_pixel_mib"] / today["batch_pixel_mib"]
        step = new["step_s"] / today["step_s"]
        ok = pixels * args.group_size <= PIXEL_BAR and step <= TIME_BAR
        results["acceptance"] = {"pixel_ratio": pixels, "step_ratio": step, "met": ok}
        md.append(
            f"packed / today: batch pixels {pixels:.3f} (acceptance <= 1/G = {1 / args.group_size:.3f}), "
            f"step time {step:.2f}x (acceptance <= {TIME_BAR}x): {'met' if ok else 'NOT met'}\n"
        )
    write_results(args.out, results, md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
