"""yatt.controllers.schedule: which weights each step's batch is generated with, when pushes may happen, and
that the producer's state survives a checkpoint (a fake producer in place of generation)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from yatt.config import ExperimentConfig
from yatt.controllers.generation import GenerationStats
from yatt.controllers.metrics import StageTimer
from yatt.controllers.schedule import AheadSchedule, Batch, SyncSchedule, build_schedule
from yatt.data.rollout import Rollout
from yatt.distributed import World
from yatt.placement.ownership import HookRole


class FakeProducer:
    """Records (step, version) per batch made; each batch is one rollout tagged with them."""

    def __init__(self, fail_at: int | None = None, seconds: float = 0.0):
        self.made: list[tuple[int, int]] = []
        self.fail_at, self.seconds = fail_at, seconds
        self.lock = threading.Lock()

    def __call__(self, step: int, timer: StageTimer, version: int) -> Batch:
        if step == self.fail_at:
            raise ValueError(f"engine exploded at step {step}")
        with timer("generate"):
            time.sleep(self.seconds)
        with self.lock:
            self.made.append((step, version))
        rollout = Rollout(None, [1], [2], [-0.5], "stop", version=version, origin=(0, step))
        return Batch([rollout], GenerationStats(rollout_s=0.1), {}, {"rollout": 0.1, "genrm": 0.0}, 0)


def train(schedule, steps: range, pushed: list | None = None) -> list[tuple[int, int]]:
    """A trainer loop: take each step's batch, 'train', push. Returns (step, version trained on)."""
    seen = []
    for step in steps:
        batch = schedule.take(step, StageTimer())
        seen.append((step, batch.rollouts[0].version))
        assert batch.rollouts[0].origin == (0, step)  # the step's own batch
        schedule.push(step, lambda s=step: pushed.append(s) if pushed is not None else None)
    return seen


def run_mains(main, schedules: dict) -> None:
    """main(rank) for ranks 0 and 1 as threads (30 s each at most), then the schedules closed."""
    threads = [threading.Thread(target=main, args=(rank,), daemon=True) for rank in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        for s in schedules.values():
            s.close()


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_step_s_is_generated_with_the_weights_of_step_s_minus_1_minus_k(staleness):
    schedule = AheadSchedule(FakeProducer(seconds=0.001), 0, staleness, last_step=10)
    try:
        seen = train(schedule, range(1, 11))
    finally:
        schedule.close()
    assert seen == [(s, max(0, s - 1 - staleness)) for s in range(1, 11)]


def test_max_staleness_0_generates_what_sync_does():
    sync = SyncSchedule(FakeProducer(), 0)
    ahead = AheadSchedule(FakeProducer(), 0, 0, last_step=6)
    try:
        assert train(sync, range(1, 7)) == train(ahead, range(1, 7)) == [(s, s - 1) for s in range(1, 7)]
    finally:
        ahead.close()


def test_a_push_waits_for_the_batch_that_uses_the_weights_before_it():
    producer = FakeProducer(seconds=0.05)
    schedule = AheadSchedule(producer, 0, 1, last_step=5)
    try:
        schedule.take(1, StageTimer())
        schedule.push(1, lambda: None)
        # pushing step 1's weights may only happen once batch 2 (made with step 0's) is complete
        assert (2, 0) in producer.made
        assert all(version <= 1 for _, version in producer.made)
    finally:
        schedule.close()


def test_the_producer_runs_while_the_trainer_trains():
    producer = FakeProducer(seconds=0.2)
    schedule = AheadSchedule(producer, 0, 1, last_step=3)
    try:
        timer = StageTimer()
        schedule.take(1, timer)
        time.sleep(0.3)  # 'training' step 1: batch 2 is generated meanwhile
        began = time.perf_counter()
        schedule.take(2, timer)
        assert time.perf_counter() - began < 0.1 and schedule.waited_s < 0.1
        assert timer.seconds["generate"] >= 0.4  # both batches' generate time reaches the steps' timers
    finally:
        schedule.close()


def test_a_checkpoint_holds_the_batches_made_ahead_and_resumes_exactly():
    uninterrupted = AheadSchedule(FakeProducer(), 0, 2, last_step=8)
    try:
        want = train(uninterrupted, range(1, 9))
    finally:
        uninterrupted.close()
    first = AheadSchedule(FakeProducer(), 0, 2, last_step=8)
    try:
        got = train(first, range(1, 4))
        state = first.state_dict()
    finally:
        first.close()
    # after step 3's push the producer made every batch up to 3 + 2 + 1 (step 3's weights feed batch 6)
    assert sorted(int(s) for s in state["ready"]) == [4, 5, 6] and state["version"] == 3
    resumed = AheadSchedule(FakeProducer(), 0, 2, last_step=8)
    resumed.load_state_dict(state)
    try:
        got += train(resumed, range(4, 9))
    finally:
        resumed.close()
    assert got == want
    assert [s for s, _ in resumed.produce.made] == [7, 8]  # the resumed producer made only the rest


def test_groups_older_than_the_bound_are_dropped_and_counted():
    class CarryOver(FakeProducer):  # like dynamic sampling's queue: batch s also holds a group of batch s - 1
        def __call__(self, step, timer, version):
            batch = super().__call__(step, timer, version)
            old = Rollout(None, [1], [3], [-0.5], "stop", version=max(0, version - 1), origin=(0, step))
            batch.rollouts.append(old)
            return batch

    schedule = AheadSchedule(CarryOver(), 0, 1, last_step=4)
    try:
        kept, dropped = [], []
        for step in range(1, 5):
            batch = schedule.take(step, StageTimer())
            kept.append(len(batch.rollouts))
            dropped.append(schedule.metrics(step, batch.rollouts)[0]["async/dropped_stale_samples"])
            schedule.push(step, lambda: None)
    finally:
        schedule.close()
    # steps 1-2 are made with step 0's weights (the carried group too: nothing older exists); from step 3 on the
    # carried group is 2 steps stale, over the bound of 1
    assert kept == [2, 2, 1, 1] and dropped == [0, 0, 1, 1]


def test_a_producer_failure_is_raised_in_the_trainer():
    schedule = AheadSchedule(FakeProducer(fail_at=3), 0, 1, last_step=6)
    try:
        with pytest.raises(RuntimeError, match="the rollout producer failed.*engine exploded at step 3"):
            train(schedule, range(1, 7))
    finally:
        schedule.close()


class Engines:
    """The engine services' side a schedule sets up (roles, kept pushes, preemption): nothing runs on them here."""

    preemption = None
    kept = False

    def device_roles(self) -> dict:
        return {}

    def keep_pushed(self) -> None:
        self.kept = True

    def heal(self) -> int:
        return 0

    heal_local = heal


def test_the_config_picks_the_schedule_and_its_devices():
    world = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
    train = HookRole(lambda: None, lambda: None)

    def build(**schedule):
        cfg = ExperimentConfig.model_validate(
            {
                "model": {"path": "m"},
                "data": {"train": {"kind": "jsonl", "files": ["t.jsonl"]}},
                "rollout": {"schedule": schedule},
                "run": {"steps": 5},
            }
        )
        engines = Engines()
        return build_schedule(cfg, FakeProducer(), engines, train, world, world, None), engines

    sync, engines = build()
    assert isinstance(sync, SyncSchedule) and sync.where.placement is sync.where.engine_placement
    assert not engines.kept and sync.stateful() == {}
    one, engines = build(mode="one_step_off", max_staleness=3)
    assert isinstance(one, AheadSchedule) and one.staleness == 1 and one.last == 5 and engines.kept
    assert one.where.placement is not one.where.engine_placement and one.stateful() == {"rollouts": one}
    resumed, engines = build(mode="async", max_staleness=3, in_flight="resume")
    assert resumed.staleness == 3 and resumed.resume and engines.preemption is resumed


def test_in_flight_resume_pushes_mid_batch_and_the_batch_goes_on_with_the_new_weights():
    """in_flight: resume: a push does not wait for the batch in flight; the producer, which checks `pending`
    between tokens as ResumingPool does between polls, lets the push happen and goes on with the new version."""
    box: dict = {}

    def produce(step: int, timer: StageTimer, version: int) -> Batch:
        schedule, versions = box["schedule"], []
        box["progress"] = versions
        for _ in range(20):  # 20 'tokens'
            if schedule.pending():
                schedule.pause()
            versions.append(schedule.version)
            time.sleep(0.005)
        rollout = Rollout(None, [1], [2] * 20, [-0.5] * 20, "stop", version=versions[0], origin=(0, step))
        rollout.token_versions = versions
        return Batch([rollout], GenerationStats(), {}, {"rollout": 0.0, "genrm": 0.0}, 0)

    schedule = box["schedule"] = AheadSchedule(produce, 0, 1, last_step=6, resume=True)
    cuts, trained = [], []
    try:
        for step in range(1, 7):
            batch = schedule.take(step, StageTimer())
            trained.append(batch.rollouts[0])
            # the push records how far the batch in flight had got (a batch being made: 0 < tokens < 20)
            schedule.push(step, lambda: cuts.append(len(box["progress"])))
            sums, _ = schedule.metrics(step, batch.rollouts)
            assert sums["async/resumed_samples"] == float(len(set(batch.rollouts[0].token_versions)) > 1)
    finally:
        schedule.close()
    assert any(0 < c < 20 for c in cuts), cuts  # pushed while a batch was half made
    for step, r in enumerate(trained, start=1):
        assert r.token_versions == sorted(r.token_versions) and r.version >= step - 2
    assert any(len(set(r.token_versions)) > 1 for r in trained)  # a batch made with two versions


def test_ranks_sharing_engines_push_together_while_a_producer_waits_on_another():
    """Partial placement with in_flight: resume, two ranks as threads in one process: each rank's producer makes its
    share of a batch, then waits for the other's (partial placement's barrier) inside `released`. Rank 1's share
    outlasts the trainer's step, so it pauses for the push while rank 0's producer already waits at the barrier;
    the main threads push together (`barrier`). Were the engines held through the producers' barrier, rank 0's push
    would wait for its producer, which waits for rank 1's, which waits for the push: the barriers time out."""
    producers, mains = threading.Barrier(2, timeout=10), threading.Barrier(2, timeout=10)
    schedules: dict[int, AheadSchedule] = {}

    def producer_of(rank: int):
        def produce(step: int, timer: StageTimer, version: int) -> Batch:
            schedule, versions = schedules[rank], []
            for _ in range(3 if rank == 0 else 40):  # 'tokens'; a paused producer goes on with the new weights
                if schedule.pending():
                    schedule.pause()
                versions.append(schedule.version)
                time.sleep(0.005)
            with schedule.released():
                producers.wait()
            rollout = Rollout(None, [1], [2] * len(versions), [-0.5] * len(versions), "stop", origin=(rank, step))
            rollout.version, rollout.token_versions = versions[0], versions
            return Batch([rollout], GenerationStats(), {}, {"rollout": 0.0, "genrm": 0.0}, 0)

        return produce

    for rank in (0, 1):
        schedules[rank] = AheadSchedule(producer_of(rank), 0, 1, last_step=4, resume=True, barrier=mains.wait)
    trained: dict[int, list[list[int]]] = {}

    def main(rank: int) -> None:
        seen = []
        for step in range(1, 5):
            seen.append(schedules[rank].take(step, StageTimer()).rollouts[0].token_versions)
            time.sleep(0.05)  # the update: rank 0's producer makes its share of the next batch meanwhile
            schedules[rank].push(step, lambda: time.sleep(0.02))
        trained[rank] = seen

    run_mains(main, schedules)
    assert sorted(trained) == [0, 1], "a rank's trainer never finished: the pushes deadlocked"
    assert any(len(set(v)) > 1 for v in trained[1]), trained[1]  # rank 1's batches were cut by pushes
    assert all(v == sorted(v) for r in trained.values() for v in r)


def test_no_producer_has_requests_on_the_engines_while_a_rank_evaluates():
    """Partial placement with in_flight: resume, two ranks as threads: evaluating switches a rank's device to
    rollout (on a GPU its judges sleep), so no producer may have requests on any engine meanwhile. Taking the
    engines is not enough: the main thread gets them while its producer waits in `released` for the slower
    rank's share at partial placement's barrier, and that rank's requests are still out. `quiesce` first (what
    ControllerShard.evaluate does): every producer has made the batches the current weights feed."""
    producers, mains = threading.Barrier(2, timeout=10), threading.Barrier(2, timeout=10)
    schedules: dict[int, AheadSchedule] = {}
    requesting, lock = set(), threading.Lock()  # the ranks whose producer has requests out

    def producer_of(rank: int):
        def produce(step: int, timer: StageTimer, version: int) -> Batch:
            schedule = schedules[rank]
            with lock:
                requesting.add(rank)
            for _ in range(2 if rank == 0 else 30):
                if schedule.pending():
                    schedule.pause()
                time.sleep(0.005)
            with lock:
                requesting.discard(rank)
            with schedule.released():
                producers.wait()
            rollout = Rollout(None, [1], [2], [-0.5], "stop", version=version, origin=(rank, step))
            return Batch([rollout], GenerationStats(), {}, {"rollout": 0.0, "genrm": 0.0}, 0)

        return produce

    for rank in (0, 1):
        schedules[rank] = AheadSchedule(producer_of(rank), 0, 1, last_step=6, resume=True, barrier=mains.wait)
    seen: dict[int, list[set]] = {}

    def main(rank: int) -> None:
        schedule, overlaps = schedules[rank], []
        for step in range(1, 7):
            schedule.take(step, StageTimer())
            schedule.push(step, lambda: None)
            schedule.quiesce()
            with schedule.engines, lock:  # the evaluation
                overlaps.append(set(requesting))
        seen[rank] = overlaps

    run_mains(main, schedules)
    assert sorted(seen) == [0, 1], "a rank's trainer never finished"
    assert seen[0] == seen[1] == [set()] * 6, seen


def test_quiesce_before_the_first_batch_returns_at_once():
    """Evaluation at step 0 quiesces before any batch was taken: there is no producer yet to wait for."""
    schedule = AheadSchedule(FakeProducer(), 0, 1, last_step=4)
    done = threading.Event()
    threading.Thread(target=lambda: (schedule.quiesce(), done.set()), daemon=True).start()
    assert done.wait(5), "quiesce waited for a producer that was never started"
    schedule.close()
