"""Which devices serve rollout and which serve GenRM during generation (partial colocation).

The split is chosen between steps from measured load ("dynamic load evaluation"): with rollout
work W_r and judge work W_g measured in device-seconds, R rollout and G = N - R judge devices take
about max(W_r / R, W_g / G); the best R within the configured bounds minimises that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationSplit:
    rollout: tuple[int, ...]  # ranks whose device runs a rollout engine during generation
    genrm: tuple[int, ...]  # ranks whose device runs a judge engine during generation

    def role_of(self, rank: int) -> str:
        return "rollout" if rank in self.rollout else "genrm"


def split_devices(world_size: int, rollout_devices: int) -> GenerationSplit:
    """The first `rollout_devices` ranks roll out, the rest judge."""
    if not 0 < rollout_devices < world_size:
        raise ValueError(f"need 1..{world_size - 1} rollout devices of {world_size}, got {rollout_devices}")
    return GenerationSplit(tuple(range(rollout_devices)), tuple(range(rollout_devices, world_size)))


def choose_rollout_devices(
    world_size: int, rollout_work_s: float, genrm_work_s: float, min_rollout: int = 1, min_genrm: int = 1
) -> int:
    """R minimising max(rollout_work / R, genrm_work / (N - R)); ties go to more rollout devices."""
    low, high = min_rollout, world_size - min_genrm
    if low > high:
        raise ValueError(f"{world_size} devices cannot hold {min_rollout} rollout + {min_genrm} GenRM devices")
    return min(range(low, high + 1), key=lambda r: (max(rollout_work_s / r, genrm_work_s / (world_size - r)), -r))


class LoadEstimate:
    """Exponential moving averages of the per-step rollout and judge work (device-seconds)."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self.rollout_s: float | None = None
        self.genrm_s: float | None = None

    def update(self, rollout_s: float, genrm_s: float) -> None:
        a = self.smoothing
        self.rollout_s = rollout_s if self.rollout_s is None else a * self.rollout_s + (1 - a) * rollout_s
        self.genrm_s = genrm_s if self.genrm_s is None else a * self.genrm_s + (1 - a) * genrm_s


class GenerationSchedule:
    """The generation split of the current step (partial colocation), re-chosen from load between steps."""

    def __init__(self, cfg, world_size: int):  # cfg: yatt.config.PlacementConfig
        self.cfg, self.world_size = cfg, world_size
        self.load = LoadEstimate(cfg.load_smoothing)
        self.split: GenerationSplit | None = None
        if cfg.mode == "partial":
            wanted = cfg.rollout_devices or -(-world_size // 2)
            bounded = min(max(wanted, cfg.min_rollout_devices), world_size - cfg.min_genrm_devices)
            self.split = split_devices(world_size, bounded)
        self.first, self.chosen = self.split, {}  # chosen: step -> the split picked after it (the recent ones)

    def split_for(self, settled: int) -> GenerationSplit | None:
        """The split a batch uses: the one picked after step `settled`, the last step every rank had finished when
        the batch started (the current split for a batch made in its own step, an older one for a batch made
        ahead of the trainer: yatt.controllers.schedule), so all ranks agree; the first split before any."""
        return self.chosen.get(settled, self.first)

    def observe(self, rollout_work_s: float, genrm_work_s: float, step: int) -> None:
        """Record step `step`'s measured work (device-seconds, same on every rank) and pick the next split."""
        if self.split is None:
            return
        self.load.update(rollout_work_s, genrm_work_s)
        if self.cfg.dynamic:
            r = choose_rollout_devices(
                self.world_size,
                self.load.rollout_s,
                self.load.genrm_s,
                self.cfg.min_rollout_devices,
                self.cfg.min_genrm_devices,
            )
            self.split = split_devices(self.world_size, r)
        self.chosen[step] = self.split
        self.chosen.pop(step - 64, None)  # ahead schedules look back at most max_staleness + 2 steps
