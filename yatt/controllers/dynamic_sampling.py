"""DAPO-style dynamic sampling: train only on groups whose rewards differ.

A group whose G rewards are all equal has zero GRPO advantage everywhere: it costs a forward and
backward and teaches nothing. Each step the sampler generates groups for about
`need x oversample ratio` prompts, drops the all-equal ones and refills from the shard's stream
until `need` groups are kept or `max_rounds` rounds have run. Kept groups beyond `need` wait in a
queue for the next step (bounded by `need`). The ratio follows the measured keep rate:
ratio = clip(1 / keep_rate_ema, min, max). Its state is plain JSON-able data for checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from yatt.algorithms.config import DynamicSamplingConfig
from yatt.data.rollout import Rollout
from yatt.distributed import World
from yatt.placement.metrics import maxed, summed

Group = list[Rollout]
GenerateGroups = Callable[[int, int], list[Group]]  # (prompts, round) -> scored groups


def has_signal(group: Group) -> bool:
    """True when the group's rewards are not all equal (its advantages are not all zero)."""
    return len({r.reward for r in group}) > 1


class DynamicSampler:
    def __init__(self, cfg: DynamicSamplingConfig):
        self.cfg = cfg
        self.ratio = cfg.initial_oversample
        self.keep_rate: float | None = None  # exponential average of kept / generated groups
        self.queue: list[Group] = []
        self.short_steps = 0

    def collect(self, need: int, generate: GenerateGroups) -> tuple[list[Group], dict[str, float]]:
        """`need` groups with reward variance (fewer after max_rounds: a short step), and this step's counts."""
        kept, self.queue = self.queue[:need], self.queue[need:]
        from_queue, generated, dropped, rounds = len(kept), 0, 0, 0
        while len(kept) < need and rounds < self.cfg.max_rounds:
            groups = generate(math.ceil((need - len(kept)) * self.ratio), rounds)
            rounds += 1
            good = [g for g in groups if has_signal(g)]
            kept += good
            generated, dropped = generated + len(groups), dropped + len(groups) - len(good)
            self._observe(len(good), len(groups))
        # Surplus waits for the next step; beyond one step's need it would only grow stale.
        surplus = kept[need:]
        self.queue = (self.queue + surplus)[:need]
        kept = kept[:need]
        short = len(kept) < need
        self.short_steps += int(short)
        return kept, {
            "dynamic_sampling/kept_groups": float(len(kept)),
            "dynamic_sampling/dropped_groups": float(dropped),
            "dynamic_sampling/generated_groups": float(generated),
            "dynamic_sampling/from_queue": float(from_queue),
            "dynamic_sampling/discarded_surplus": float(max(0, len(surplus) - len(self.queue))),
            "dynamic_sampling/oversample_ratio": self.ratio,
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/queue": float(len(self.queue)),
            "dynamic_sampling/short_steps": float(self.short_steps),
        }

    def _observe(self, kept: int, generated: int) -> None:
        if generated == 0:
            return
        rate = kept / generated
        a = self.cfg.ema
        self.keep_rate = rate if self.keep_rate is None else a * rate + (1 - a) * self.keep_rate
        wanted = 1.0 / self.keep_rate if self.keep_rate > 0 else math.inf
        self.ratio = min(self.cfg.max_oversample, max(self.cfg.min_oversample, wanted))

    def state_dict(self) -> dict:
        return {
            "ratio": self.ratio,
            "keep_rate": self.keep_rate,
            "short_steps": self.short_steps,
            "queue": [[r.to_dict() for r in g] for g in self.queue],
        }

    def load_state_dict(self, state: dict) -> None:
        self.ratio, self.keep_rate = float(state["ratio"]), state["keep_rate"]
        self.short_steps = int(state["short_steps"])
        self.queue = [[Rollout.from_dict(r) for r in g] for g in state["queue"]]


def in_groups(rollouts: list[Rollout], size: int) -> list[Group]:
    """Consecutive groups of `size` (generation returns a prompt's samples together)."""
    return [rollouts[i : i + size] for i in range(0, len(rollouts), size)]


def reduce_metrics(world: World, metrics: dict[str, float]) -> dict[str, float]:
    """Over ranks: counts summed, the ratio averaged, rounds and short steps as the worst rank's."""
    ordered = {k: metrics[k] for k in sorted(metrics)}  # the same order on every rank
    out, maxes = summed(world, ordered), maxed(world, ordered)
    out["dynamic_sampling/oversample_ratio"] /= world.size
    for k in ("dynamic_sampling/rounds", "dynamic_sampling/short_steps"):
        out[k] = maxes[k]
    return out
