"""Step time and trainer memory: every efficiency option off, each one on, and all of them, side by side.

    OMP_NUM_THREADS=1 python benchmarks/step_time.py [--workload quickstart|100m|all] [--steps 40]
        [--trainer-steps 2] [--config configs/quickstart.yaml] [--model PATH] [--variants NAME ...]
        [--against REV] [--out benchmarks/results/step_time]

"all off" is the reference of the ratios; every other variant turns some options on (yatt.config TrainerConfig
pack_sequences / share_prompts / logprob_chunk_tokens / micro_batch_tokens / activation_checkpointing /
autocast, AlgorithmConfig old_logprobs). Variants run one after the other, never at once, on the same data and
seeds. (benchmarks/results/step_time.md also has a row for the code before these options, d1693d4, measured
by this script's earlier version.)

Workloads:
- quickstart (its "megatron TP=2" variant runs the defaults on the megatron backend, one tensor-parallel group
  of both ranks; the report gives its step time over the torch backend's, "all (defaults)"): real RL runs,
  `torchrun --nproc_per_node 2 launch/train.py --config configs/quickstart.yaml
  --placement full` (or --config) for --steps steps each (no eval, no checkpoints). Per variant: the median over steps
  (the first 3 left out: warm-up) of the step time and of each stage's time (max over ranks, as logged in
  metrics.jsonl), the rollout-vs-trainer log-prob mismatch, and the peak RSS of each rank process (VmHWM,
  sampled from /proc; the rank process only — engines are separate processes).
- 100m: the trainer alone (log-prob pass + one optimizer step, what a step's logprobs and update stages
  run) on 2 ranks (gloo), a 100M-class model: SmolLM2-135M's shape (30 layers, hidden 576, 49,152-token
  vocabulary, tied embeddings) with random weights, or --model PATH (e.g. a converted SmolLM2-135M). 16
  samples per rank (32 per step) as an RL batch holds them: 2 prompts of 32-96 tokens with 8 responses each
  (consecutive rows), responses of 64-128 tokens. Per variant: the
  mean over --trainer-steps steps after one warm-up step, and the peak trainer memory per rank = peak RSS
  (VmHWM) minus the RSS before the model was loaded. The log-prob drift of each variant against the
  padded float32 path on the same weights shows what activation checkpointing and bf16 autocast change.

Writes <out>.json (everything), <out>.md (tables with ratios to "all off") and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import (
    add_worker_args,
    commit,
    pyplot,
    rank_result,
    run_worker,
    shown,
    slug,
    smollm2_shaped,
    table,
    vm_kib,
    write_results,
)

REPO = Path(__file__).resolve().parents[1]
FULL_HEAD = {"torch": {"logprob_chunk_tokens": 0}}  # trainer.torch: the torch backend's own section
OFF = {"pack_sequences": False, "share_prompts": False, "micro_batch_tokens": 0, **FULL_HEAD}
PACKED = {"pack_sequences": True, "share_prompts": False, "micro_batch_tokens": 0, **FULL_HEAD}
# the option variants keep one engine (with the KV cache the quickstart gave it), so they differ by trainer only
VLLM = ["rollout.engine.backend=vllm", "rollout.engine.vllm.kv_cache_gib=0.5"]
REFERENCE = "all off"  # every option off: the ratios' denominator and, on 100m, the float32 padded log-probs
QUICKSTART = {  # variant: (trainer settings, algorithm settings, other overrides)
    "all off": (OFF, {"old_logprobs": "recompute"}, VLLM),
    "+packed": (PACKED, {"old_logprobs": "recompute"}, VLLM),
    "+shared prompts": (PACKED | {"share_prompts": True}, {"old_logprobs": "recompute"}, VLLM),
    "+reuse pass": (OFF, {"old_logprobs": "reuse"}, VLLM),
    "all, vllm engine": ({}, {}, VLLM),
    # the config's own engine (the quickstart's is hf; both sample the same distribution: README)
    "all (defaults)": ({}, {}, []),
    # the same defaults on the megatron backend, one model-parallel group of 2 (generation split over it)
    "megatron TP=2": ({}, {}, ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=2"]),
    # Python's automatic garbage collections instead of one per step on every rank (run.gc)
    "all (defaults), gc auto": ({}, {}, ["run.gc=auto"]),
    "megatron TP=2, gc auto": (
        {},
        {},
        ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=2", "run.gc=auto"],
    ),
}
TRAINER_100M = {
    "all off": (OFF, {"old_logprobs": "recompute"}),
    "+packed": (PACKED, {"old_logprobs": "recompute"}),
    "+shared prompts": (PACKED | {"share_prompts": True}, {"old_logprobs": "recompute"}),
    "+chunked head": (OFF | {"torch": {"logprob_chunk_tokens": 256}}, {"old_logprobs": "recompute"}),
    "+token budget": (PACKED | {"micro_batch_tokens": 2048}, {"old_logprobs": "recompute"}),
    "+reuse pass": (OFF, {"old_logprobs": "reuse"}),
    "all (defaults)": ({}, {}),
    "all + act. ckpt": ({"torch": {"activation_checkpointing": True}}, {}),
    "all + bf16 autocast": ({"torch": {"autocast": "bfloat16"}}, {}),
}
WARMUP_STEPS = 3  # quickstart: steps left out of the medians
GROUP = 8  # 100m: samples per prompt, as the quickstart's and the SmolLM2 config's group_size
STAGES = ("generate", "reward", "balance", "logprobs", "advantages", "update", "sync")


class PeakRss:
    """Samples VmHWM of the rank processes under a torchrun (children running launch/train.py)."""

    def __init__(self, root: int):
        self.root, self.peak_kib, self._stop = root, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.25):
            try:
                children = psutil.Process(self.root).children()
            except psutil.Error:
                continue
            for child in children:
                try:
                    if "launch/train.py" in " ".join(child.cmdline()):
                        self.peak_kib[child.pid] = max(self.peak_kib.get(child.pid, 0), vm_kib(child.pid, "VmHWM"))
                except psutil.Error:
                    pass

    def stop(self) -> list[float]:
        self._stop.set()
        self.thread.join()
        return sorted(k / 2**20 for k in self.peak_kib.values())  # GiB per rank


def checkout_at(rev: str, work: Path) -> Path:
    """This repository at git revision `rev` in a detached worktree under `work`, sharing this checkout's models/
    (built, not committed); the caller removes it (`git worktree remove`)."""
    tree = work / f"at-{slug(rev)}"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True, capture_output=True)
    (tree / "models").symlink_to(REPO / "models")
    return tree


def run_quickstart(
    name: str, config: Path, trainer: dict, algo: dict, steps: int, work: Path, other: list[str], repo: Path = REPO
) -> dict:
    """One variant: `steps` RL steps of `config` (a path under REPO) run from the checkout `repo`."""
    run_name = slug(name)
    # dynamic sampling off: every variant trains the same samples per step, so the step times compare the same work
    overrides = [
        f"run.steps={steps}",
        "run.eval_every=0",
        "checkpoint.every=0",
        "run.export_policy=false",
        f"run.output_dir={work}",
        f"run.name={run_name}",
        "algorithm.dynamic_sampling.enabled=false",
    ]
    overrides += [f"trainer.{k}={json.dumps(v)}" for k, v in trainer.items()]
    overrides += [f"algorithm.{k}={v}" for k, v in algo.items()] + list(other)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "launch/train.py",
        "--config",
        str(repo / config.resolve().relative_to(REPO)),
        "--placement",
        "full",
        "--resume",
        "none",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    start = time.perf_counter()
    with open(work / f"{slug(name)}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        rss = PeakRss(proc.pid)
        rc = proc.wait()
    peaks = rss.stop()
    if rc:
        # the log lives in a temporary folder that goes with the exception: show its end
        tail = (work / f"{slug(name)}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"variant {name!r} failed (exit {rc}); the end of its log:\n{tail}")
    run_dir = work / run_name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r.get("step", 0) > WARMUP_STEPS and "time/step_s" in r]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in steps_)

    return {
        "variant": name,
        "step_s": median("time/step_s"),
        **{f"{s}_s": median(f"time/{s}_s") for s in STAGES},
        "lp_diff_mean": median("rollout/trainer_logprob_diff_mean"),
        "reward_last": steps_[-1]["reward/mean"],
        "peak_rss_gib": peaks,
        "wall_s": time.perf_counter() - start,
        "steps": len(steps_),
    }


# ---- the 100M trainer workload: this file is also the worker, under torchrun --------------------


def trainer_worker(args: argparse.Namespace) -> None:
    import torch

    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig, TrainerConfig
    from yatt.distributed import init_world
    from yatt.tensors import TokenBatch
    from yatt.trainers.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    world = init_world()
    trainer_cfg, algo_cfg = json.loads(args.trainer), json.loads(args.algo)
    rss_before = vm_kib(os.getpid(), "VmRSS")
    trainer = TorchTrainer(args.model, TrainerConfig(lr=1e-5, micro_batch_size=64, **trainer_cfg), world)
    rng = random.Random(1000 + world.rank)
    vocab = trainer.hf_config.vocab_size
    # an RL batch: GROUP samples of each prompt, as consecutive rows (2 prompts x 8 samples per rank)
    prompts = [
        p
        for p in ([rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))] for _ in range(16 // GROUP))
        for _ in range(GROUP)
    ]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 128))] for _ in range(16)]
    batch = TokenBatch.from_sequences(prompts, responses, pad_id=0)
    batch.extras["advantages"] = torch.tensor([rng.uniform(-1, 1) for _ in prompts])
    algorithm = Algorithm(AlgorithmConfig(**{k: v for k, v in algo_cfg.items() if k != "old_logprobs"}))
    # one mini-batch: with old_logprobs = reuse all of it is on-policy
    reuse = algo_cfg.get("old_logprobs", AlgorithmConfig().old_logprobs) == "reuse"
    probe = trainer.logprobs(batch)[0]  # before any update: the drift against the float32 padded path
    times = []
    for step in range(args.trainer_steps + 1):
        world.barrier()
        start = time.perf_counter()
        if reuse:
            batch.extras["on_policy"] = torch.ones(len(batch))
        else:
            batch.extras["old_logprobs"] = trainer.logprobs(batch)[0]
        middle = time.perf_counter()
        tokens, seqs = world.sum([float(batch.mask.sum()), float(len(batch))])
        trainer.train_mini_batch(batch, algorithm.objective(tokens / world.size, seqs / world.size, 128))
        end = time.perf_counter()
        if step:  # step 0 warms up
            times.append((middle - start, end - middle))
    out = {
        "rank": world.rank,
        "logprobs_s": statistics.mean(t[0] for t in times),
        "update_s": statistics.mean(t[1] for t in times),
        "peak_trainer_gib": (vm_kib(os.getpid(), "VmHWM") - rss_before) / 2**20,
        "peak_rss_gib": vm_kib(os.getpid(), "VmHWM") / 2**20,
    }
    rank_result(args.result, world.rank).write_text(json.dumps(out))
    torch.save(probe, rank_result(args.result, world.rank, ".pt"))


def run_trainer(name: str, trainer: dict, algo: dict, model: Path, steps: int, work: Path) -> dict:
    import torch

    result = work / slug(name)
    start = time.perf_counter()
    ranks = run_worker(
        name,
        Path(__file__),
        [
            "--model",
            str(model),
            "--trainer",
            json.dumps(trainer),
            "--algo",
            json.dumps(algo),
            "--trainer-steps",
            str(steps),
        ],
        result,
        REPO,
    )
    probes = [torch.load(rank_result(result, r, ".pt")) for r in range(2)]
    return {
        "variant": name,
        "logprobs_s": max(r["logprobs_s"] for r in ranks),
        "update_s": max(r["update_s"] for r in ranks),
        "trainer_s": max(r["logprobs_s"] + r["update_s"] for r in ranks),
        "peak_trainer_gib": max(r["peak_trainer_gib"] for r in ranks),
        "peak_rss_gib": max(r["peak_rss_gib"] for r in ranks),
        "wall_s": time.perf_counter() - start,
        "_probes": probes,
    }


def chosen(variants: dict, names: list[str] | None) -> dict:
    if names is None:
        return variants
    unknown = set(names) - set(variants)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {list(variants)}")
    return {k: v for k, v in variants.items() if k in {REFERENCE, *names}}


# ---- report ----------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = [k for k in ("quickstart", "100m") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = results[key]
        names = [r["variant"] for r in rows]
        bottom = [0.0] * len(rows)
        stages = [f"{s}_s" for s in STAGES] if key == "quickstart" else ["logprobs_s", "update_s"]
        for stage in stages:
            values = [r[stage] for r in rows]
            ax.barh(names, values, left=bottom, label=stage[:-2])
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xlabel("seconds per step (max over ranks)")
        ax.set_title(f"{key}: step time by stage")
        ax.invert_yaxis()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("quickstart", "100m", "all"), default="all")
    parser.add_argument(
        "--steps",
        type=int,
        default=40,
        help=f"quickstart: RL steps per variant (the first {WARMUP_STEPS} are left out)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=REPO / "configs/quickstart.yaml",
        help="quickstart: the experiment each variant trains",
    )
    parser.add_argument("--trainer-steps", type=int, default=2, help="100m: timed trainer steps per variant")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="100m: a Hugging Face folder instead of the random SmolLM2-shaped model",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=None,
        help=f"only these variants (names as in the "
        f"tables; {REFERENCE!r} is always run: ratios and drift are relative to it)",
    )
    parser.add_argument(
        "--against",
        default=None,
        metavar="REV",
        help="quickstart: also run the defaults from git revision REV (a temporary worktree), right after this "
        "checkout's, as the variant 'all (defaults) at REV': the step time before and after a change",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/step_time")
    add_worker_args(parser, "--trainer", "--algo")
    args = parser.parse_args()
    if args.worker:
        trainer_worker(args)
        return 0
    if args.workload != "100m" and args.steps <= WARMUP_STEPS:
        parser.error(f"--steps: more than the {WARMUP_STEPS} warm-up steps")
    hidden = ("worker", "trainer", "algo", "result")  # the worker's flags
    paths = {"out": shown(args.out), "config": shown(args.config), "model": args.model and shown(args.model)}
    results: dict = {"settings": {k: v for k, v in vars(args).items() if k not in hidden} | paths}
    with tempfile.TemporaryDirectory(prefix="yatt-step-time-") as tmp:
        work = Path(tmp)
        if args.workload in ("quickstart", "all"):
            rows = []
            for name, (trainer, algo, other) in chosen(QUICKSTART, args.variants).items():
                print(f"quickstart / {name} ...", flush=True)
                rows.append(run_quickstart(name, args.config, trainer, algo, args.steps, work, other))
                print(
                    f"  step {rows[-1]['step_s']:.3f} s  (logprobs {rows[-1]['logprobs_s']:.3f}, update "
                    f"{rows[-1]['update_s']:.3f}, generate {rows[-1]['generate_s']:.3f})",
                    flush=True,
                )
                if args.against and name == "all (defaults)":
                    tree = checkout_at(args.against, work)
                    try:
                        print(f"quickstart / {name} at {args.against} ...", flush=True)
                        rows.append(run_quickstart(f"{name} at {args.against}", args.config, trainer, algo,
                                                   args.steps, work, other, repo=tree))  # fmt: skip
                        print(f"  step {rows[-1]['step_s']:.3f} s", flush=True)
                    finally:
                        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
            results["quickstart"] = rows
        if args.workload in ("100m", "all"):
            model = args.model or smollm2_shaped(REPO / "models/bench-smollm2-shape")
            rows = []
            for name, (trainer, algo) in chosen(TRAINER_100M, args.variants).items():
                print(f"100m trainer / {name} ...", flush=True)
                rows.append(run_trainer(name, trainer, algo, model, args.trainer_steps, work))
                print(
                    f"  trainer {rows[-1]['trainer_s']:.2f} s/step, peak trainer memory "
                    f"{rows[-1]['peak_trainer_gib']:.2f} GiB",
                    flush=True,
                )
            reference = next(r["_probes"] for r in rows if r["variant"] == REFERENCE)
            for r in rows:
                r["logprob_drift_max"] = max(float((p - q).abs().max()) for p, q in zip(r.pop("_probes"), reference))
            results["100m"] = rows
    md = ["# Step time: every efficiency option off, each one on, and all of them\n"]
    if "quickstart" in results:
        md += [
            f"## {shown(args.config)} (2 ranks, median of steps {WARMUP_STEPS + 1}-{args.steps})\n",
            table(
                results["quickstart"],
                [
                    ("step_s", "step s"),
                    ("generate_s", "generate"),
                    ("logprobs_s", "logprobs"),
                    ("update_s", "update"),
                    ("sync_s", "sync"),
                    ("balance_s", "balance"),
                    ("lp_diff_mean", "rollout-trainer |dlogp|"),
                ],
                ["step_s"],
            ),
            "",
        ]
        steps = {r["variant"]: r["step_s"] for r in results["quickstart"]}
        if {"megatron TP=2", "all (defaults)"} <= set(steps):
            ratio = steps["megatron TP=2"] / steps["all (defaults)"]
            md += [f"megatron TP=2 / all (defaults), median step time: **{ratio:.2f}x**\n"]
        before = f"all (defaults) at {args.against}"
        if before in steps and "all (defaults)" in steps:
            ratio = steps["all (defaults)"] / steps[before]
            md += [f"all (defaults) at {commit()} / at {args.against}, median step time: **{ratio:.2f}x**\n"]
    if "100m" in results:
        md += [
            "## 100M-class trainer (2 ranks, 32 samples, responses 64-128 tokens)\n",
            table(
                results["100m"],
                [
                    ("logprobs_s", "logprobs s"),
                    ("update_s", "update s"),
                    ("trainer_s", "trainer s"),
                    ("peak_trainer_gib", "peak trainer GiB"),
                    ("logprob_drift_max", "max |dlogp| vs fp32"),
                ],
                ["trainer_s", "peak_trainer_gib"],
            ),
            "",
        ]
    write_results(args.out, results, md)
    plot(results, Path(f"{args.out}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
