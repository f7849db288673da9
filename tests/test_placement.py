"""Placement without engines: the generation split, its choice from load, and device ownership."""

import pytest

from yatt.config import PlacementConfig
from yatt.placement.metrics import engine_busy
from yatt.placement.ownership import DeviceOwnership, HookRole
from yatt.placement.plan import GenerationSchedule, choose_rollout_devices, split_devices


def test_split_devices():
    s = split_devices(4, 3)
    assert s.rollout == (0, 1, 2) and s.genrm == (3,)
    assert s.role_of(0) == "rollout" and s.role_of(3) == "genrm"
    with pytest.raises(ValueError):
        split_devices(2, 2)


@pytest.mark.parametrize(
    "n, rollout_s, genrm_s, expected",
    [
        (8, 7.0, 1.0, 7),  # judge is cheap: 7 rollout devices, 1 judge
        (8, 1.0, 1.0, 4),  # equal work: half and half
        (8, 1.0, 7.0, 1),  # judge is expensive
        (2, 5.0, 0.1, 1),  # two devices: the only split
        (8, 3.0, 1.0, 6),  # max(3/6, 1/2) = 0.5 beats max(3/5, 1/3) and max(3/7, 1)
    ],
)
def test_choose_rollout_devices(n, rollout_s, genrm_s, expected):
    assert choose_rollout_devices(n, rollout_s, genrm_s) == expected


def test_choose_respects_bounds():
    assert choose_rollout_devices(8, 100.0, 0.0, min_rollout=1, min_genrm=3) == 5
    assert choose_rollout_devices(8, 0.0, 100.0, min_rollout=2, min_genrm=1) == 2
    with pytest.raises(ValueError):
        choose_rollout_devices(2, 1.0, 1.0, min_rollout=2, min_genrm=1)


def test_schedule_follows_measured_load():
    sched = GenerationSchedule(PlacementConfig(mode="partial", load_smoothing=0.0), 8)
    assert sched.split.rollout == (0, 1, 2, 3)
    sched.observe(rollout_work_s=7.0, genrm_work_s=1.0, step=1)
    assert len(sched.split.rollout) == 7
    sched.observe(rollout_work_s=1.0, genrm_work_s=7.0, step=2)
    assert len(sched.split.rollout) == 1
    # a batch uses the split picked after the last step all ranks had finished when it started (made ahead of
    # the trainer: an older one), the first split before any
    assert len(sched.split_for(2).rollout) == 1 and len(sched.split_for(1).rollout) == 7
    assert sched.split_for(0).rollout == (0, 1, 2, 3)


def test_schedule_static_and_full():
    static = GenerationSchedule(PlacementConfig(mode="partial", dynamic=False, rollout_devices=3), 4)
    static.observe(0.0, 100.0, step=1)
    assert static.split.rollout == (0, 1, 2)
    full = GenerationSchedule(PlacementConfig(mode="full"), 4)
    full.observe(1.0, 1.0, step=1)
    assert full.split is None


def test_ownership_switches_run_hooks_and_charge_time():
    calls = []
    role = lambda name: HookRole(lambda: calls.append(f"off:{name}") or {}, lambda: calls.append(f"on:{name}") or {})
    own = DeviceOwnership(
        {"rollout": role("rollout"), "genrm": role("genrm"), "train": role("train")}, initial_owner="rollout"
    )
    with own.own("rollout"):
        pass
    own.acquire("genrm")
    with own.own("train"):
        pass
    assert calls == ["off:rollout", "on:genrm", "off:genrm", "on:train"]
    m = own.take_metrics()
    assert m["placement/switches"] == 2
    assert set(k for k in m if k.startswith("placement/owned_")) == {
        "placement/owned_rollout_s",
        "placement/owned_genrm_s",
        "placement/owned_train_s",
    }
    with pytest.raises(KeyError, match="unknown role"):
        own.acquire("critic")


def test_engine_busy_is_the_seconds_since_the_last_reading_per_kind():
    before = {"rollout": 1.0, "genrm-a": 2.0}
    now = {"rollout": 4.0, "genrm-a": 2.5, "genrm-b": 1.0}  # b restarted, or new: counted from 0
    assert engine_busy(before, now) == {"rollout": 3.0, "genrm": 1.5}
    assert engine_busy(now, {"rollout": 0.5, "genrm-a": 3.0, "genrm-b": 1.0}) == {"rollout": 0.0, "genrm": 0.5}
