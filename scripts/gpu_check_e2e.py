"""GPU check of the whole RL loop on one GPU, without vLLM: does the GPU path run end to end?

    python scripts/gpu_check_e2e.py [--steps 30] [--out DIR] [--config configs/quickstart.yaml] [--model DIR]
        [--trainer-backend torch|megatron] [--dtype bfloat16|float32] [--max-logprob-diff X] [--composed]
        [--schedule sync|one_step_off|async]

Runs `torchrun --nproc_per_node 1 launch/train.py` (so the process group is real: NCCL for model tensors,
gloo for metadata, world size 1) on the quickstart config for `--steps` steps with the `hf` rollout engine
and the trainer (`--trainer-backend`, torch by default) both in `--dtype` (bfloat16 by default), under full
placement: every step the engine sleeps (weights off the GPU) while the trainer trains, and the trainer
offloads (its weights or gradients and its optimizer state to host) while the engine generates.
`scripts/gpu_check_megatron.py` is this check with the megatron backend. It needs models/quickstart-policy
(`python launch/sft.py --config configs/sft_quickstart.yaml` builds it in about a minute on CPU; carry it to
the GPU machine). Then it checks, from metrics.jsonl and the exported policy:

- finite loss: actor/policy_loss and actor/grad_norm finite at every step, no skipped optimizer step;
- moving weights: the exported policy differs from the starting one;
- engine/trainer agreement: the mean |log p_engine - log p_trainer| per response token stays under
  --max-logprob-diff (by default 0.05 nats in bfloat16: both sides run bfloat16 matmuls, but the engine
  decodes with a KV cache and the trainer runs whole sequences, so they round differently; 1e-3 in float32,
  where the two agree to about 1e-6, tests/test_hf_engine.py);
- offload frees memory: placement/offload_freed_bytes > 0 at every step (engine sleep + trainer offload);
- the step ran collectives under NCCL: the run's process-group backend, as the rank reports it.

With --composed, the run composes the features a user at scale turns on together: the config (by default
configs/quickstart_genrm.yaml, which needs models/quickstart-judge too: `make quickstart-genrm` builds it) is
judged by its GenRM judges on hf engines in --dtype (judging between rollout and training, under full
placement), with balancing on and `checkpoint.export_hf`; it also checks
- judged: every step's samples went through the judges (genrm/judged > 0);
- export loads: the last checkpoint's policy/ folder loads with transformers and gives finite logits.

With --schedule one_step_off (or async), rollout runs ahead of the trainer (rollout.schedule, docs/async.md):
the engine is given the one GPU explicitly (rollout.engine.gpus=[0]: on a machine with more, engines would
take GPUs of their own) and generates while the trainer trains; nothing is offloaded, so that check is
skipped, and it checks
- ran ahead: the trained samples were generated with older weights (async/staleness_mean > 0);
and engine/trainer agreement is checked on the steps whose samples the trainer's weights generated (staleness 0,
the first step).

Prints one JSON report (also written to --out as gpu_check_e2e.json) and exits 1 if a check fails. About 2
minutes on one H200.
Without a GPU it runs the same loop on the CPU and reports the two GPU-only checks (offload frees memory,
NCCL) as skipped, which keeps the script working in the CPU test suite (tests/test_gpu_check_e2e.py).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
from yatt.trainers import TRAINERS  # noqa: E402  (the registry only: no torch or megatron import)

MAX_LOGPROB_DIFF = {"bfloat16": 0.05, "float32": 1e-3}  # default --max-logprob-diff by dtype (see above)


def main(argv: list[str] | None = None, name: str = "gpu_check_e2e", doc: str = __doc__, **defaults) -> int:
    """The check; `name` names the report file and the run, `defaults` replace the options' defaults (how
    another entry point, e.g. gpu_check_megatron.py, makes this check its own)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="default: configs/quickstart.yaml (quickstart_genrm.yaml if --composed)",
    )
    parser.add_argument("--model", type=Path, default=None, help="the policy folder (default: the config's)")
    parser.add_argument("--trainer-backend", choices=TRAINERS.names(), default="torch", help="trainer.backend")
    parser.add_argument(
        "--dtype", choices=tuple(MAX_LOGPROB_DIFF), default="bfloat16", help="trainer.dtype and rollout.engine.dtype"
    )
    parser.add_argument("--max-logprob-diff", type=float, default=None, help="default: by --dtype")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report into this folder")
    parser.add_argument("--composed", action="store_true", help="GenRM judges, balancing and export_hf (see above)")
    parser.add_argument(
        "--schedule", choices=("sync", "one_step_off", "async"), default="sync", help="rollout.schedule.mode (above)"
    )
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    max_diff = MAX_LOGPROB_DIFF[args.dtype] if args.max_logprob_diff is None else args.max_logprob_diff
    import torch

    gpu = torch.cuda.is_available()
    from yatt.config import load_experiment

    args.config = args.config or REPO / (
        "configs/quickstart_genrm.yaml" if args.composed else "configs/quickstart.yaml"
    )
    runs = Path(tempfile.mkdtemp(prefix=f"yatt-{name}-"))
    if args.composed:  # the config with its judges on hf engines: this machine may have no vLLM
        tree = yaml.safe_load(args.config.read_text())
        for judge in tree.get("reward", {}).get("judges", []):
            engine = {k: v for k, v in (judge.get("engine") or {}).items() if k != "vllm"}
            judge["engine"] = engine | {"backend": "hf", "dtype": args.dtype}
        args.config = runs / args.config.name
        args.config.write_text(yaml.safe_dump(tree))
    model = (args.model or load_experiment(args.config).model.path).resolve()
    if not (model / "config.json").is_file():
        print(
            f"{model} not found: build it with `python launch/sft.py --config configs/sft_quickstart.yaml`",
            file=sys.stderr,
        )
        return 2
    overrides = [
        f"model.path={model}",
        f"run.output_dir={runs}",
        f"run.name={name}",
        f"run.steps={args.steps}",
        "run.eval_every=0",
        "data.eval_prompts=64",
        f"checkpoint.every={max(1, args.steps // 3)}",
        "rollout.engine.backend=hf",
        "rollout.engine.vllm=null",
        f"rollout.engine.dtype={args.dtype}",
        f"trainer.dtype={args.dtype}",
        f"trainer.backend={args.trainer_backend}",
    ]
    if args.composed:
        overrides += ["balance.enabled=true", "checkpoint.export_hf=true"]
    ahead = args.schedule != "sync"
    if ahead:  # one GPU: the engine shares the trainer's, asked for explicitly (rollout.engine.gpus)
        overrides += [f"rollout.schedule.mode={args.schedule}", "rollout.engine.gpus=[0]"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        str(REPO / "launch/train.py"),
        "--config",
        str(args.config.resolve()),
        "--placement",
        "full",
        "--resume",
        "none",
        *overrides,
    ]
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    report: dict = {
        "command": " ".join(cmd[2:]),
        "returncode": proc.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "dtype": args.dtype,
        "max_logprob_diff": max_diff,
        "device": torch.cuda.get_device_name(0) if gpu else "cpu (GPU-only checks skipped)",
    }
    run_dir = runs / name
    if (run_dir / "config.yaml").is_file():  # the backend the run says it trained with
        report["trainer_backend"] = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["backend"]
    records = (
        [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "metrics.jsonl").is_file()
        else []
    )
    steps = [r for r in records if r["step"] > 0]
    checks: dict[str, bool] = {"ran": proc.returncode == 0 and len(steps) == args.steps}
    if steps:
        lp_diff = [r["rollout/trainer_logprob_diff_mean"] for r in steps]
        freed = [r["placement/offload_freed_bytes"] for r in steps]
        report.update(
            policy_loss=[round(r["actor/policy_loss"], 5) for r in steps],
            grad_norm=[round(r["actor/grad_norm"], 4) for r in steps],
            reward_mean_first_last=[steps[0]["reward/mean"], steps[-1]["reward/mean"]],
            logprob_diff_mean_max=max(lp_diff),
            logprob_diff_max_max=max(r["rollout/trainer_logprob_diff_max"] for r in steps),
            offload_freed_mib_min=min(freed) / 2**20,
            step_s_median=sorted(r["time/step_s"] for r in steps)[len(steps) // 2],
            switch_s_median=sorted(r["placement/switch_s"] for r in steps)[len(steps) // 2],
            accuracy=[records[0].get("eval/accuracy"), steps[-1].get("eval/accuracy")],
        )
        checks["finite_loss"] = all(
            math.isfinite(r["actor/policy_loss"])
            and math.isfinite(r["actor/grad_norm"])
            and r["actor/skipped_steps"] == 0
            for r in steps
        )
        # ahead of the trainer a batch's log-probs are of older weights than the trainer's: compare where they
        # are the same (the staleness-0 steps, e.g. the first)
        fresh = [r["rollout/trainer_logprob_diff_mean"] for r in steps if r.get("async/staleness_mean", 0.0) == 0]
        checks["logprobs_agree"] = bool(fresh) and max(fresh) <= max_diff
        if args.composed:
            report["judged"] = [r.get("genrm/judged", 0) for r in steps]
            checks["judged"] = min(report["judged"]) > 0
        if ahead:
            report["staleness_mean"] = [round(r.get("async/staleness_mean", 0.0), 3) for r in steps]
            checks["ran_ahead"] = max(report["staleness_mean"]) > 0
        if gpu and not ahead:  # ahead of the trainer nothing changes owner: the trainer keeps its GPU memory
            checks["offload_frees_memory"] = min(freed) > 0
    backend = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "process group backend" in line]
    report["backend"] = backend[-1] if backend else None
    if gpu:
        checks["nccl_group"] = bool(backend) and "nccl" in backend[-1]
    if (run_dir / "policy").is_dir():
        from safetensors.torch import load_file

        before, after = load_file(model / "model.safetensors"), load_file(run_dir / "policy/model.safetensors")
        moved = {k: float((after[k].float() - before[k].float()).abs().max()) for k in before if k in after}
        report["max_weight_change"] = max(moved.values())
        checks["weights_moved"] = report["max_weight_change"] > 0
    else:
        checks["weights_moved"] = False
    if args.composed:
        checks["export_loads"] = exported_policy_loads(run_dir, report)
    report["checks"] = checks
    report["skipped"] = [] if gpu else ["nccl_group"]
    if ahead or not gpu:
        report["skipped"].insert(0, "offload_frees_memory")
    report["ok"] = all(checks.values())
    if not report["ok"]:
        report["stderr_tail"] = proc.stderr[-4000:]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(text + "\n")
    return 0 if report["ok"] else 1


def exported_policy_loads(run_dir: Path, report: dict) -> bool:
    """The last checkpoint's policy/ (checkpoint.export_hf) loads as a causal LM and scores a prompt finitely."""
    import torch
    from transformers import AutoModelForCausalLM

    exports = sorted(run_dir.glob("checkpoints/step-*/policy"))
    if not exports:
        return False
    report["export"] = exports[-1].relative_to(run_dir).as_posix()
    model = AutoModelForCausalLM.from_pretrained(exports[-1])
    with torch.no_grad():
        logits = model(torch.arange(1, 9).unsqueeze(0)).logits
    return bool(torch.isfinite(logits).all())


if __name__ == "__main__":
    sys.exit(main())
