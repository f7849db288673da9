"""Per-step metrics: what the step measures, and where it goes (one JSON line per step in metrics.jsonl, and
a readable progress line).

The step's metrics are pure functions over named reductions: `step_reductions` gives this rank's values to
sum and to max over ranks, the shard reduces each dict by name in one all-reduce (yatt.placement.metrics:
summed, maxed), and `step_metrics` turns the reduced dicts into the logged metrics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from yatt.algorithms import kl_estimate, masked_sum
from yatt.balance.workload import sample_workload
from yatt.checkpoint.manifest import write_atomic
from yatt.config import ExperimentConfig
from yatt.data.rollout import Rollout
from yatt.placement.metrics import maxed, summed
from yatt.tensors import TokenBatch

STAGES = ("generate", "reward", "balance", "logprobs", "advantages", "update", "sync")


@dataclass
class StepResult:
    """What a step hands the run (yatt.controllers.shard.ControllerShard.step)."""

    metrics: dict[str, float]  # reduced over ranks: the same on every rank
    rollouts: list[Rollout]  # this rank's, as generated (samples.jsonl shows some)
    samples_trained: int  # by this rank since the run began (dynamic sampling and balancing vary it)


class StageTimer:
    """Seconds per named stage of one step: `with timer("generate"): ...`."""

    def __init__(self, stages: tuple[str, ...] = ()):
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)  # same keys on every rank, even if unused

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def step_reductions(
    cfg: ExperimentConfig,
    stats: tuple[str, ...],
    rollouts: list[Rollout],
    batch: TokenBatch,
    entropy: Tensor,
    ref_lp: Tensor | None,
    update: dict[str, float],
    stage_seconds: dict[str, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's part of the step's metrics: (values to sum over ranks, values to max over ranks), by name.
    `rollouts`: what this rank trained (after dynamic sampling and rebalancing); `stats`: the algorithm's loss
    statistics, which `update` holds as sums over the trained tokens."""
    mask = batch.mask
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    groups = rewards.view(-1, cfg.rollout.group_size)
    lp_diff = (batch.extras["old_logprobs"] - batch.extras["rollout_logprobs"]).abs() * mask
    kl_ref = (
        float(masked_sum(kl_estimate(batch.extras["old_logprobs"], ref_lp, cfg.algorithm.kl_estimator), mask))
        if ref_lp is not None
        else 0.0
    )
    lengths = mask.sum(dim=1)
    workload = sum(
        sample_workload(len(r.prompt_ids), len(r.response_ids), cfg.balance.attention_coef) for r in rollouts
    )
    sums = {
        "reward": float(rewards.sum()),
        "correct": float((rewards >= 1.0).sum()),
        "samples": float(len(rollouts)),
        "resp_tokens": float(lengths.sum()),
        "truncated": float(sum(r.finish_reason == "length" for r in rollouts)),
        "entropy": float(masked_sum(entropy, mask)),
        "lp_diff": float(lp_diff.sum()),
        "kl_ref": kl_ref,
        "zero_var_groups": float((groups.std(dim=1) == 0).sum()),
        "solved_groups": float((groups.max(dim=1).values >= 1.0).sum()),
        "groups": float(groups.shape[0]),
        "workload": workload,
        "tokens": update["tokens"],
        **{f"actor/{name}": update[name] for name in stats},
        # an MoE policy's routing-mismatch counts (Trainer.routing_counts), when the engine returns its routing
        **{k: v for k, v in update.items() if k.startswith("routing/")},
    }
    if cfg.reward.teacher is not None:  # on-policy distillation: student - teacher log-prob of the sampled tokens
        teacher = batch.extras.get("teacher_logprobs", torch.zeros_like(mask))  # a rank may hold no samples
        sums["distill_kl"] = float(masked_sum(batch.extras["rollout_logprobs"] - teacher, mask))
    peaks = {  # a rank may hold no samples
        "response/length_max": float(lengths.max()) if lengths.numel() else 0.0,
        "rollout/trainer_logprob_diff_max": float(lp_diff.max()) if lp_diff.numel() else 0.0,
        "workload": workload,
        **{f"time/{k}_s": stage_seconds[k] for k in sorted(stage_seconds)},  # sorted: the same order on every rank
    }
    return sums, peaks


def step_metrics(
    cfg: ExperimentConfig,
    stats: tuple[str, ...],
    world_size: int,
    s: dict[str, float],
    peaks: dict[str, float],
    update: dict[str, float],
) -> dict[str, float]:
    """The step's metrics from step_reductions' dicts summed (`s`) and maxed (`peaks`) over ranks, and this
    rank's `update` (grad_norm, lr and skipped are the same on every rank)."""
    steps = max(update["optimizer_steps"], 1.0)
    den = {k: max(s[k], 1.0) for k in ("tokens", "samples", "resp_tokens", "groups")}  # 0 when nothing was kept
    metrics = {
        "reward/mean": s["reward"] / den["samples"],
        "reward/correct_frac": s["correct"] / den["samples"],
        "reward/zero_variance_group_frac": s["zero_var_groups"] / den["groups"],
        "reward/pass_at_group": s["solved_groups"] / den["groups"],  # groups with >= 1 fully correct sample
        "response/length_mean": s["resp_tokens"] / den["samples"],
        "response/length_max": peaks["response/length_max"],
        "response/truncated_frac": s["truncated"] / den["samples"],
        **{f"actor/{name}": s[f"actor/{name}"] / den["tokens"] for name in stats},
        "actor/entropy": s["entropy"] / den["resp_tokens"],
        "actor/kl_ref": s["kl_ref"] / den["resp_tokens"],
        "actor/grad_norm": update["grad_norm"] / steps,
        "actor/lr": update["lr"] / steps,
        "actor/skipped_steps": update["skipped"],
        "rollout/trainer_logprob_diff_mean": s["lp_diff"] / den["resp_tokens"],
        "rollout/trainer_logprob_diff_max": peaks["rollout/trainer_logprob_diff_max"],
        "rollout/samples": s["samples"],
        **{k: v for k, v in peaks.items() if k.startswith("time/")},
        # an MoE policy's load-balancing loss and expert load, per optimizer step (yatt.trainers.moe)
        **{k: v / steps for k, v in update.items() if k.startswith("moe/")},
    }
    if not cfg.balance.enabled:  # what a balance plan would report: max over mean rank workload, nothing moved
        imbalance = peaks["workload"] * world_size / s["workload"] if s["workload"] > 0 else 1.0
        metrics.update(
            {
                "balance/imbalance_before": imbalance,
                "balance/imbalance_after": imbalance,
                "balance/moved_samples": 0.0,
                "balance/moved_pixel_bytes": 0.0,
            }
        )
    metrics["perf/gen_tokens_per_s"] = s["resp_tokens"] / max(metrics["time/generate_s"], 1e-9)
    if "distill_kl" in s:  # the mean per-token reverse KL(student || teacher) on the student's samples
        metrics["distill/reverse_kl"] = s["distill_kl"] / den["resp_tokens"]
    if cfg.algorithm.dynamic_sampling.enabled:
        metrics["dynamic_sampling/trained_zero_var_groups"] = s["zero_var_groups"]
    # the response tokens predicted on other experts by the trainer's router (its own top-k) than by the engine's
    if s.get("routing/tokens", 0.0) > 0:
        metrics["moe/routing_mismatch"] = s["routing/tokens_differ"] / s["routing/tokens"]
        metrics["moe/routing_mismatch_layers"] = s["routing/layers_differ"] / s["routing/layers"]
    return metrics


def train_metrics(cfg, algo, world, trained, batch, entropy, ref_lp, update, seconds) -> dict[str, float]:
    """The step's training metrics over `world`'s ranks (step_reductions summed and maxed, then step_metrics),
    the behaviour/trainer log-prob mismatch (after the update: with old_logprobs=reuse its first forwards filled
    in the on-policy rows' log-probs) and the KL coefficient the step used. `algo`: yatt.algorithms.Algorithm."""
    sums, peaks = step_reductions(cfg, algo.stats, trained, batch, entropy, ref_lp, update, seconds)
    metrics = step_metrics(cfg, algo.stats, world.size, summed(world, sums), maxed(world, peaks), update)
    metrics.update(algo.mismatch_metrics(batch, world))
    metrics["actor/kl_coef"] = algo.kl_coef
    return metrics


def agent_sums(rollouts: list[Rollout]) -> dict[str, float]:
    """This rank's agent-loop counts to sum over ranks (rollouts as generated and rewarded, before balancing).
    A useful call is a well-formed call that ran without error, in a trajectory with a full reward (>= 1)."""
    stat = lambda r, name: r.agent_stats.get(name, 0.0)
    ok = lambda r: stat(r, "tool_calls") - stat(r, "tool_errors")
    return {
        "samples": float(len(rollouts)),
        "turns": sum(stat(r, "num_turns") for r in rollouts),
        "calls": sum(stat(r, "tool_calls") for r in rollouts),
        "malformed": sum(stat(r, "malformed_tool_calls") for r in rollouts),
        "errors": sum(stat(r, "tool_errors") for r in rollouts),
        "useful": sum(ok(r) for r in rollouts if r.reward >= 1.0),
        "with_call": float(sum(stat(r, "tool_calls") + stat(r, "malformed_tool_calls") > 0 for r in rollouts)),
        "env_tokens": float(sum(len(r.response_mask) - sum(r.response_mask) for r in rollouts)),
        "resp_tokens": float(sum(len(r.response_ids) for r in rollouts)),
    }


def agent_metrics(s: dict[str, float], prefix: str) -> dict[str, float]:
    """The agent loop's metrics from `agent_sums` summed over ranks: turns and calls per sample, and the fractions
    of the calls written (well-formed or not) that parsed, ran without error, and were useful."""
    written = max(s["calls"] + s["malformed"], 1.0)
    samples = max(s["samples"], 1.0)
    return {
        f"{prefix}/turns_mean": s["turns"] / samples,
        f"{prefix}/tool_calls_per_sample": (s["calls"] + s["malformed"]) / samples,
        f"{prefix}/samples_with_call_frac": s["with_call"] / samples,
        f"{prefix}/wellformed_call_frac": s["calls"] / written,
        f"{prefix}/ok_call_frac": (s["calls"] - s["errors"]) / written,
        f"{prefix}/useful_call_frac": s["useful"] / written,
        f"{prefix}/tool_token_frac": s["env_tokens"] / max(s["resp_tokens"], 1.0),
    }


def loop_metrics(world, rollouts: list[Rollout], split: str = "") -> dict[str, float]:
    """A multi-turn loop's metrics over `world`'s ranks (collectives): `{split}agent/...` (agent_metrics) and the
    environment's named scores, `{split}env/...`. `split`: "" for a step's rollouts, "eval/" for an evaluation's."""
    agent = agent_metrics(summed(world, agent_sums(rollouts)), f"{split}agent")
    return {**agent, **env_score_metrics(world, rollouts, f"{split}env")}


def env_score_metrics(world, rollouts: list[Rollout], prefix: str) -> dict[str, float]:
    """The environment's named scores (Rollout.env_scores: a verifiers task's rewards and metrics), each the mean
    over the samples of all ranks that have it. A name is known only once an episode recorded it (a scoring
    function may return several), so the ranks first agree on the union of their names."""
    names = sorted(set().union(*world.all_gather_object(sorted({n for r in rollouts for n in r.env_scores}))))
    if not names:  # a loop that records none (all ranks agree): no reductions
        return {}
    sums = summed(world, {n: sum(r.env_scores.get(n, 0.0) for r in rollouts) for n in names})
    counts = summed(world, {n: float(sum(n in r.env_scores for r in rollouts)) for n in names})
    return {f"{prefix}/{n}": sums[n] / counts[n] for n in names if counts[n]}


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Written by rank 0 only; other ranks hold a disabled logger so callers need no rank checks."""

    def __init__(
        self, path: Path, total_steps: int, enabled: bool, sinks: list = (), resumed: tuple[int, float] = (0, 0.0)
    ):
        """`sinks`: more places every record goes (TensorBoard, wandb; yatt.controllers.sinks). `resumed`: the step
        a resumed run starts after and the elapsed seconds logged there, so `elapsed_s` runs on across launches
        and the ETA counts only this launch's steps."""
        self.path, self.total_steps, self.enabled, self.sinks = path, total_steps, enabled, list(sinks)
        self.start_step, self.elapsed_before = resumed
        self.start = time.perf_counter()
        self._file = open(path, "a", encoding="utf-8") if enabled else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        elapsed = self.elapsed_before + time.perf_counter() - self.start
        record = {"step": step, "elapsed_s": round(elapsed, 3), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.log(step, {k: v for k, v in record.items() if k != "step"})
        print(self.console_line(step, metrics, elapsed), flush=True)

    def console_line(self, step: int, m: dict[str, float], elapsed: float) -> str:
        parts = [f"step {step:>4}/{self.total_steps}"]
        if "reward/mean" in m:
            parts.append(f"reward {m['reward/mean']:.3f}")
        if "eval/accuracy" in m:
            parts.append(
                f"eval acc {m['eval/accuracy']:.3f}" + (f" score {m['eval/score']:.3f}" if "eval/score" in m else "")
            )
        if "response/length_mean" in m:
            parts.append(f"len {m['response/length_mean']:.1f}")
            parts.append(
                f"ent {m['actor/entropy']:.3f} clip {m['actor/clip_frac']:.3f} gnorm {m['actor/grad_norm']:.2f}"
            )
            if "critic/value_loss" in m:  # PPO with a critic (w: a warm-up step, the policy did not train)
                parts.append(
                    f"vloss {m['critic/value_loss']:.4f} ev {m['critic/explained_var']:.2f}"
                    + (" w" if m.get("critic/warmup") else "")
                )
            parts.append(
                f"gen {m['time/generate_s']:.2f}s upd {m['time/update_s']:.2f}s "
                f"sync {m['time/sync_s']:.2f}s {m['perf/gen_tokens_per_s']:.0f} tok/s"
            )
        parts.append(f"{_duration(elapsed)} elapsed")
        if (done := step - self.start_step) > 0:  # this launch's pace
            parts[-1] += f", eta {_duration((elapsed - self.elapsed_before) / done * (self.total_steps - step))}"
        return " | ".join(parts)

    def close(self) -> None:
        if self._file:
            self._file.close()
        for sink in self.sinks:
            sink.close()


def keep_metrics_until(path: Path, step: int) -> list[dict]:
    """Keep the records of steps <= `step` (a resumed run continues from there) and return them.

    A crash can leave lines for steps after the checkpoint, which the resumed run logs again.
    """
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in records if r["step"] <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept
