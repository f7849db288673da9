"""Per-step placement metrics: how long each device served each role, how idle it was, and how the
judges kept up. Every function reduces over ranks, so every rank must call it with the same keys;
`step_placement_metrics` is the step's whole set.

`summed` and `maxed` are the named reductions the controller's metrics use too: a dict of this rank's values
in, the same keys reduced over ranks out, in one all-reduce each.
"""

from __future__ import annotations

from yatt.distributed import World
from yatt.placement.engine_lifecycle import ROLLOUT
from yatt.placement.plan import GenerationSplit

ROLES = ("rollout", "genrm", "train")


def summed(world: World, values: dict[str, float]) -> dict[str, float]:
    """`values` summed over ranks, by name (every rank passes the same keys in the same order)."""
    return dict(zip(values, world.sum(list(values.values()))))


def maxed(world: World, values: dict[str, float]) -> dict[str, float]:
    """`values` maxed over ranks, by name (every rank passes the same keys in the same order)."""
    return dict(zip(values, world.max(list(values.values()))))


def engine_busy(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """Seconds this rank's rollout engines and its judge engines stepped between two readings of
    EngineServices.busy_seconds() (per role, a judge engine each)."""
    busy = {role: max(0.0, s - before.get(role, 0.0)) for role, s in now.items()}
    rollout = busy.pop(ROLLOUT, 0.0)
    return {"rollout": rollout, "genrm": sum(busy.values())}


def step_placement_metrics(
    world: World,
    devices: World,
    busy: dict[str, float],
    owned: dict[str, float],
    restarts: int,
    restarted: int,
    gen,
    split: GenerationSplit | None,
    step_s: float,
    judges: dict,
    rollouts: list,
    teacher: bool = False,
) -> dict[str, float]:
    """One step's placement metrics. `busy`: this rank's seconds of engine work (engine_busy) and of training
    ("train"); `owned`: DeviceOwnership.take_metrics(); `restarts`: this rank's engine restarts during the step
    (EngineServices.take_restarts), `restarted`: all ranks' before it (EngineServices.heal); `gen`: the step's
    yatt.controllers.generation.GenerationStats of this rank's model-parallel group; `split`: the step's (None: full
    colocation on all devices). `world` is the data-parallel one (samples count once per data-parallel rank),
    `devices` the torchrun world (engine and device time count per device; the same as `world` unless the model is
    split over ranks), so every rank sees the same load and picks the same next split."""
    load = summed(
        devices,
        {"load/rollout_busy_s": busy["rollout"], "load/genrm_busy_s": busy["genrm"], "restarts": float(restarts)},
    )
    restarted += int(load.pop("restarts"))
    out = {
        **load,
        **maxed(
            devices,
            {
                "placement/switch_s": owned["placement/switch_s"],
                "placement/offload_freed_bytes": owned["placement/offload_freed_bytes"],
                "time/rollout_phase_s": gen.rollout_s,
                "time/judge_tail_s": gen.judge_tail_s,
            },
        ),
        "placement/switches": owned["placement/switches"],
        "placement/engine_restarts": float(restarted),
        "placement/rollout_devices": float(len(split.rollout) if split else devices.size),
        "placement/genrm_devices": float(len(split.genrm) if split else devices.size),
    }
    out.update(device_metrics(devices, owned, busy["rollout"] + busy["genrm"] + busy["train"], step_s))
    if judges:
        out.update(
            judge_metrics(
                world, judges, rollouts, gen.judged, gen.unparseable, load["load/genrm_busy_s"], gen.max_judge_queue
            )
        )
    out.update(pool_metrics(world, gen.pools, list(judges), teacher))
    return out


def device_metrics(world: World, owned: dict[str, float], busy_s: float, step_s: float) -> dict[str, float]:
    """device{r}/owned_{role}_s and device{r}/idle_frac for every device: a W x 4 table, one all-reduce.

    Idle is the part of the step in which the device computed nothing: not stepping an engine, not
    training; e.g. a rollout device waiting for the slowest group, or any device waiting on a barrier.
    """
    table = {
        f"device{r}/{key}": 0.0
        for r in range(world.size)
        for key in [*(f"owned_{role}_s" for role in ROLES), "idle_frac"]
    }
    me = f"device{world.rank}"
    for role in ROLES:
        table[f"{me}/owned_{role}_s"] = owned.get(f"placement/owned_{role}_s", 0.0)
    table[f"{me}/idle_frac"] = min(1.0, max(0.0, 1.0 - busy_s / max(step_s, 1e-9)))
    out = summed(world, table)
    out["placement/idle_frac_mean"] = sum(out[f"device{r}/idle_frac"] for r in range(world.size)) / world.size
    return out


POOL_EVENTS = ("rerouted", "respawned", "duplicates_dropped")


def pool_metrics(world: World, pools: dict[str, float], judge_names, teacher: bool = False) -> dict[str, float]:
    """Requests re-routed from dead engines, engines respawned and late duplicates dropped, per pool kind (the
    distillation teacher's too, with `teacher`)."""
    kinds = ["rollout", *(f"genrm/{n}" for n in judge_names), *(["teacher"] if teacher else [])]
    keys = [f"{kind}/{event}" for kind in kinds for event in POOL_EVENTS]
    return summed(world, {k: pools.get(k, 0.0) for k in keys})  # fixed keys: a rank may have had no pools


def judge_metrics(
    world: World, judges: dict, rollouts: list, judged: int, unparseable: int, judge_busy_s: float, max_queue: int
) -> dict[str, float]:
    """Throughput (judged responses per busy judge-second), unreadable verdicts, queue depth, and
    agreement of each judge with the rule verifier. `judge_busy_s`: every device's judge engine time, already
    summed over the torchrun world: summing it over `world` instead (the data-parallel one) would count only the
    judges of this rank's data-parallel peers, none at all on a rollout device of a model-parallel group in
    partial placement (64 judged / 1e-9 s logged), while `judged` counts each response once per data-parallel rank."""
    local = {"genrm/judged": float(judged), "unparseable": float(unparseable), "samples": float(len(rollouts))}
    for name, judge in judges.items():
        threshold = judge.cfg.verdict.pass_threshold
        local[f"genrm/{name}/agree_with_rule"] = float(
            sum((r.judge_scores[name] > threshold) == (r.rule_score >= 1.0) for r in rollouts)
        )
    s = summed(world, local)
    repeats = sum(j.cfg.repeats for j in judges.values()) / len(judges)
    out = {
        "genrm/judged": s["genrm/judged"],
        "genrm/judged_per_busy_s": s["genrm/judged"] / max(judge_busy_s, 1e-9),
        "genrm/unparseable_frac": s["unparseable"] / max(s["genrm/judged"] * repeats, 1.0),
        **maxed(world, {"genrm/max_queue": float(max_queue)}),
    }
    out.update({k: v / max(s["samples"], 1.0) for k, v in s.items() if k.endswith("agree_with_rule")})
    return out
