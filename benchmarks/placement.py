"""Full vs partial colocation on the same workload, side by side, 2 CPU ranks.

    python benchmarks/placement.py [--steps 6] [--prompts 32] [--out benchmarks/results/placement]

Workloads (same seed, data, models and steps in both modes):
- long_tail: a tiny random policy whose end-of-sequence logit is boosted so response lengths are
  long-tailed (most stop early, some run to the limit), and a judge of the same size that always
  writes its full verdict budget, so judging costs about as much as rolling out. This is where
  partial colocation should win: the judge works on finished groups while the tail is still rolling.
- quickstart: configs/quickstart_genrm.yaml (short responses, a cheap judge), when its models exist.

Writes <out>.json, <out>.md (the table) and <out>.png. Step 1 is left out of the means (warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import pyplot  # noqa: E402  (benchmarks/ is on the path: this file runs as a script)

from yatt.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402

EOS = 2


def scaled_eos_model(folder: Path, seed: int, eos_scale: float, positions: int) -> Path:
    """A random tiny Qwen2 whose eos embedding row (tied to the output layer) is scaled: >1 makes eos
    likelier at some positions (long-tailed lengths), 0 makes it (almost) never come."""
    cfg = TinyModelConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
    )
    write_tiny_model(folder, cfg, seed=seed)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][EOS] *= eos_scale
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def long_tail_config(work: Path, steps: int, prompts: int) -> Path:
    # eos x10: half the responses stop within 5 tokens, 1 in 10 runs past 22, 1 in 100 past 118 (measured
    # with HF sampling); the judge never stops early, so each verdict costs 12 decode steps.
    policy = scaled_eos_model(work / "policy", seed=11, eos_scale=10.0, positions=160)
    judge = scaled_eos_model(work / "judge", seed=12, eos_scale=0.0, positions=160)
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": "addition"}
        for a in range(100, 140)
        for b in range(100, 140)
    ]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = work / "long_tail.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data: {{train: {{kind: jsonl, files: [{work / "train.jsonl"}]}}, prompts_per_step: {prompts}, max_prompt_tokens: 8}}
rollout: {{group_size: 8, max_new_tokens: 128, engine: {{max_num_seqs: 256, vllm: {{kv_cache_gib: 0.5}}}}}}
reward:
  kind: genrm_with_rule
  judges:
    - name: judge
      model: {judge}
      template: "{{question}}{{reference}}:{{response}}?"
      max_tokens: 12
      engine: {{max_num_seqs: 256, vllm: {{kv_cache_gib: 0.5}}}}
trainer: {{lr: 1.0e-4, micro_batch_size: 64}}
run: {{steps: {steps}, eval_every: 0, export_policy: false}}
""")
    return config


def run_mode(config: Path, mode: str, name: str, runs: Path, extra: list[str]) -> list[dict]:
    """One 2-rank training run of `config` in placement `mode`, written under `runs`; its step records."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_name = f"{name}-{mode}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(REPO / "launch/train.py"),
        "--config",
        str(config),
        "--placement",
        mode,
        f"run.name={run_name}",
        f"run.output_dir={runs}",
        *extra,
    ]
    print("$", " ".join(cmd[3:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (runs / run_name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] > 0]


def summarize(records: list[dict]) -> dict:
    kept = records[1:] or records  # step 1 warms up caches and kernels
    mean = lambda key: statistics.fmean(r[key] for r in kept)  # noqa: E731
    return {
        "steps": len(kept),
        "step_s": mean("time/step_s"),
        "generation_s": mean("time/generate_s"),
        "rollout_phase_s": mean("time/rollout_phase_s"),
        "judge_tail_s": mean("time/judge_tail_s"),
        "idle_frac": mean("placement/idle_frac_mean"),
        "reward": mean("reward/mean"),
        "response_len_mean": mean("response/length_mean"),
        "response_len_max": max(r["response/length_max"] for r in kept),
        "truncated_frac": mean("response/truncated_frac"),
        "judged_per_busy_s": mean("genrm/judged_per_busy_s"),
        "rollout_busy_s": mean("load/rollout_busy_s"),
        "genrm_busy_s": mean("load/genrm_busy_s"),
    }


def table(results: dict) -> str:
    lines = [
        "| workload | mode | step s | generation s | rollout phase s | judge tail s | device idle | reward |"
        " resp len mean/max | rollout / judge busy s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, modes in results.items():
        for mode, s in modes.items():
            lines.append(
                f"| {workload} | {mode} | {s['step_s']:.2f} | {s['generation_s']:.2f} | "
                f"{s['rollout_phase_s']:.2f} | {s['judge_tail_s']:.2f} | {s['idle_frac']:.2f} | "
                f"{s['reward']:.3f} | {s['response_len_mean']:.1f}/{s['response_len_max']:.0f} | "
                f"{s['rollout_busy_s']:.2f} / {s['genrm_busy_s']:.2f} |"
            )
        if {"full", "partial"} <= set(modes):
            ratio = modes["partial"]["generation_s"] / modes["full"]["generation_s"]
            lines.append(
                f"| {workload} | partial/full | {modes['partial']['step_s'] / modes['full']['step_s']:.2f} "
                f"| {ratio:.2f} | | | | | | |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = list(results)
    for ax, key, title in zip(
        axes, ("step_s", "generation_s", "idle_frac"), ("step time (s)", "generation phase (s)", "device idle fraction")
    ):
        for i, mode in enumerate(("full", "partial")):
            values = [results[w].get(mode, {}).get(key, 0.0) for w in names]
            ax.bar([x + 0.38 * i for x in range(len(names))], values, width=0.38, label=mode)
        ax.set_xticks([x + 0.19 for x in range(len(names))], names)
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32, help="long_tail: prompts per step (8 samples each)")
    parser.add_argument("--out", default="benchmarks/results/placement")
    parser.add_argument("--skip-quickstart", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="yatt-placement-") as tmp:
        config = long_tail_config(Path(tmp), args.steps, args.prompts)
        runs = Path(tmp) / "runs"
        results["long_tail"] = {
            mode: summarize(run_mode(config, mode, "long_tail", runs, [])) for mode in ("full", "partial")
        }
        quick = REPO / "configs/quickstart_genrm.yaml"
        if not args.skip_quickstart and (REPO / "models/quickstart-judge").is_dir():
            extra = [f"run.steps={args.steps}", "run.eval_every=0", "run.export_policy=false"]
            results["quickstart"] = {
                mode: summarize(run_mode(quick, mode, "quickstart", runs, extra)) for mode in ("full", "partial")
            }
    text = table(results)
    print(text)
    Path(f"{out}.md").write_text(text + "\n")
    Path(f"{out}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(f"{out}.png"))


if __name__ == "__main__":
    main()
