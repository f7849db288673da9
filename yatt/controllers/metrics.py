"""Per-step metrics: one JSON line per step in metrics.jsonl, and a readable progress line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from yatt.checkpoint.manifest import write_atomic


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Written by rank 0 only; other ranks hold a disabled logger so callers need no rank checks."""

    def __init__(self, path: Path, total_steps: int, enabled: bool, sinks: list = ()):
        """`sinks`: more places every record goes (TensorBoard, wandb; yatt.controllers.sinks)."""
        self.path, self.total_steps, self.enabled, self.sinks = path, total_steps, enabled, list(sinks)
        self.start = time.perf_counter()
        self._file = open(path, "a", encoding="utf-8") if enabled else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
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
            parts.append(f"eval acc {m['eval/accuracy']:.3f}" + (f" score {m['eval/score']:.3f}"
                                                                 if "eval/score" in m else ""))
        if "response/length_mean" in m:
            parts.append(f"len {m['response/length_mean']:.1f}")
            parts.append(f"ent {m['actor/entropy']:.3f} clip {m['actor/clip_frac']:.3f} "
                         f"gnorm {m['actor/grad_norm']:.2f}")
            if "critic/value_loss" in m:  # PPO with a critic (w: a warm-up step, the policy did not train)
                parts.append(f"vloss {m['critic/value_loss']:.4f} ev {m['critic/explained_var']:.2f}"
                             + (" w" if m.get("critic/warmup") else ""))
            parts.append(f"gen {m['time/generate_s']:.2f}s upd {m['time/update_s']:.2f}s "
                         f"sync {m['time/sync_s']:.2f}s {m['perf/gen_tokens_per_s']:.0f} tok/s")
        eta = elapsed / step * (self.total_steps - step) if step else math.nan
        parts.append(f"{_duration(elapsed)} elapsed" + (f", eta {_duration(eta)}" if step else ""))
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
