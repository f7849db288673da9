"""When a step's rollouts are generated relative to the updates that train on them (`rollout.schedule`).

sync: each step generates its batch with the latest weights, trains on it and pushes the new weights, one
after the other, so the engines idle while the trainer works and the other way round.

one_step_off and async: a producer thread of this controller generates later steps' batches while the main
thread trains. There is no central queue: every controller runs its own producer on its own data shard and
engines. Step s's batch is generated with the weights of step max(start, s - 1 - k), where k is
`max_staleness` (one_step_off: k = 1); the push of step u's weights waits until the batch that uses the
weights before it (batch u + k) is complete. A batch is generated from start to end with one version (its
in-flight requests finish on the old weights before a push), and which version each batch gets does not
depend on thread timing, so k = 0 is the sync schedule's run exactly, and a run is reproducible and resumes
exactly: a checkpoint waits until the producer has made every batch that the saved weights' predecessors
feed (it then waits for the next push), and stores those batches. Every use of the engines (a generation
round, a push, a health check, an evaluation) holds `engines`, so the two threads never share an engine
connection.

in_flight: resume (partial rollouts) gives up reproducibility for fresher tokens: a push does not wait for the
batch in flight. The producer's rollout pool (yatt.engines.resume.ResumingPool) sees the push `pending`,
interrupts its requests, lets go of the engines until the push is done (`pause`) and resumes each unfinished
sample on the new weights with the tokens it has; each token keeps the version that sampled it
(Rollout.token_versions) and the staleness bound applies to the version a batch starts with. While the producer
waits on other ranks (their share of a model-parallel group's prompts, partial placement's barriers) it lets go
of the engines (`released`), so that a push is never held up by a producer waiting for one that paused for it.
With partial placement every rank's producer uses every rank's engines, so the ranks push together (`barrier`,
over the main threads): once every producer has let go of the engines, and again once every engine holds the
new weights, before any producer resumes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from yatt.config import ScheduleConfig
from yatt.controllers.generation import GenerationStats
from yatt.controllers.metrics import StageTimer
from yatt.data.rollout import Rollout
from yatt.distributed import World
from yatt.placement.metrics import maxed, summed

PRODUCER_STAGES = ("generate", "reward")


@dataclass
class Batch:
    """One step's scored rollouts and what making them measured."""

    rollouts: list[Rollout]
    stats: GenerationStats
    counts: dict[str, float]  # this rank's dynamic sampling counts ({} when off)
    busy: dict[str, float]  # engine seconds per role (yatt.placement.metrics.engine_busy)
    restarted: int  # engines restarted on all ranks before it (EngineServices.heal; 0: the step counts them)

    def to_dict(self) -> dict:
        return {**asdict(self), "rollouts": [r.to_dict() for r in self.rollouts]}

    @classmethod
    def from_dict(cls, d: dict) -> Batch:
        rollouts = [Rollout.from_dict(r) for r in d["rollouts"]]
        return cls(**{**d, "rollouts": rollouts, "stats": GenerationStats(**d["stats"])})


Produce = Callable[[int, StageTimer, int], Batch]  # (step, timer, weights version) -> the step's batch


class SyncSchedule:
    """Generate, then train, then push: the step's batch is produced when the step asks for it."""

    def __init__(self, produce: Produce, version: int):
        self.produce, self.version = produce, version
        self.engines = contextlib.nullcontext()

    def released(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def take(self, step: int, timer: StageTimer) -> Batch:
        return self.produce(step, timer, self.version)

    def settled(self, step: int) -> int:
        """The last step every rank has finished when batch `step` starts: the one before it."""
        return step - 1

    def held(self) -> list[Rollout]:
        """The rollouts of batches made and not yet trained on: none."""
        return []

    def push(self, step: int, push: Callable[[], None]) -> None:
        push()
        self.version = step

    def metrics(self, step: int, rollouts: list[Rollout]) -> tuple[dict[str, float], dict[str, float]]:
        return {}, {}

    def close(self) -> None:
        pass


class AheadSchedule:
    """one_step_off / async: a producer thread keeps up to `staleness` batches ahead of the trainer."""

    def __init__(
        self,
        produce: Produce,
        version: int,
        staleness: int,
        last_step: int,
        resume: bool = False,
        barrier: Callable[[], None] | None = None,
    ):
        self.produce, self.staleness, self.last, self.barrier = produce, staleness, last_step, barrier
        self.start = self.version = version  # the step whose weights the engines hold
        self.engines = threading.RLock()
        # in_flight: resume: a push does not wait for the batch in flight; the producer's rollout pool
        # (yatt.engines.resume.ResumingPool) sees `pending`, interrupts its requests and `pause`s for the push
        self.resume, self.pushing = resume, False
        self.engines_free = threading.Condition(self.engines)
        self.changed = threading.Condition()
        self.ready: dict[int, tuple[Batch, dict[str, float]]] = {}  # step -> (batch, its stage seconds)
        self.next = version + 1  # the next batch the producer makes
        self.error: BaseException | None = None
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.waited_s = self.producer_busy_s = 0.0
        self.depth = 0  # batches made ahead when the trainer took its last one
        self.dropped = 0  # samples of the last batch older than the bound

    def weights_for(self, step: int) -> int:
        return max(self.start, step - 1 - self.staleness)

    def settled(self, step: int) -> int:
        """The last step every rank has finished when batch `step` starts (it waits for the push of the weights
        it is generated with, which ends that step's update): the one before those weights'."""
        return self.weights_for(step) - 1

    def _startable(self) -> bool:
        return self.next <= self.last and self.version >= self.weights_for(self.next)

    def _run(self) -> None:
        try:
            while True:
                with self.changed:
                    self.changed.wait_for(lambda: self.stopping or self._startable())
                    if self.stopping:
                        return
                    step, version = self.next, self.version
                timer, began = StageTimer(PRODUCER_STAGES), time.perf_counter()
                with self.engines:
                    batch = self.produce(step, timer, version)
                with self.changed:
                    self.ready[step] = (batch, timer.seconds)
                    self.producer_busy_s += time.perf_counter() - began
                    self.next = step + 1
                    self.changed.notify_all()
        except BaseException as e:  # handed to the main thread, which raises it at its next take
            with self.changed:
                self.error = e
                self.changed.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        """Wait (holding `changed`) until done() or the producer failed (raised here)."""
        self.changed.wait_for(lambda: done() or self.error is not None)
        if self.error is not None:
            raise RuntimeError(f"the rollout producer failed: {self.error!r}") from self.error

    def take(self, step: int, timer: StageTimer) -> Batch:
        """Step `step`'s batch, waiting for it; its generate/reward seconds go to `timer`."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="yatt-rollout-producer", daemon=True)
            self.thread.start()
        began = time.perf_counter()
        with self.changed:
            self._wait(lambda: step in self.ready)
            batch, seconds = self.ready.pop(step)
            self.depth = len(self.ready)
        self.waited_s = time.perf_counter() - began
        # groups dynamic sampling carried over from an earlier batch can be older than the bound: dropped
        fresh = [r for r in batch.rollouts if r.version >= step - 1 - self.staleness]
        self.dropped, batch.rollouts = len(batch.rollouts) - len(fresh), fresh
        for name, s in seconds.items():
            timer.seconds[name] = timer.seconds.get(name, 0.0) + s
        return batch

    def push(self, step: int, push: Callable[[], None]) -> None:
        """Push step `step`'s weights: once the batch that uses the weights before them is made (finish), or
        as soon as the producer has interrupted what it has in flight (resume)."""
        if self.resume:
            self.pushing = True
        else:
            with self.changed:
                self._wait(lambda: self.next > min(step + self.staleness, self.last))
        with self.engines:  # the producer lets go at the end of a batch, in `pause`, or `released`
            if self.resume and self.barrier is not None:
                self.barrier()  # no rank's producer has requests on any engine
            push()
            if self.resume and self.barrier is not None:
                self.barrier()  # every engine holds the new weights before a producer resumes on them
            with self.changed:
                self.version = step
                self.changed.notify_all()
            self.pushing = False
            self.engines_free.notify_all()

    # the producer's side of a push in flight (yatt.engines.resume.Preemption)
    def pending(self) -> bool:
        return self.pushing

    def pause(self) -> int:
        """On the producer thread, which holds `engines`: let it go until the push is done (Condition.wait
        releases the lock however deeply it is held); the version pushed."""
        with self.engines_free:
            self.engines_free.wait_for(lambda: not self.pushing)
        return self.version

    @contextlib.contextmanager
    def released(self):
        """On the producer thread, around a wait on other ranks' producers (in_flight: resume): let go of the
        engines meanwhile, however deeply held, as `pause` does, so that this rank's push can go ahead while a
        producer it waits for is paused for the push. (The RLock's own save/restore, what Condition.wait uses.)"""
        if not self.resume:
            yield
            return
        state = self.engines._release_save()
        try:
            yield
        finally:
            self.engines._acquire_restore(state)

    def metrics(self, step: int, rollouts: list[Rollout]) -> tuple[dict[str, float], dict[str, float]]:
        """This rank's (to sum over ranks, to max over ranks): the staleness of what it trained (in steps), the
        batches made ahead, the time the trainer waited for its batch and the producer's busy time."""
        lags = [step - 1 - r.version for r in rollouts] or [0]
        busy, self.producer_busy_s = self.producer_busy_s, 0.0
        sums = {"async/staleness_sum": float(sum(lags)), "async/samples": float(len(lags))}
        sums["async/resumed_samples"] = float(sum(len(set(r.token_versions)) > 1 for r in rollouts))
        sums["async/dropped_stale_samples"] = float(self.dropped)
        peaks = {"async/staleness_max": float(max(lags)), "async/queue_depth": float(self.depth)}
        return sums, {**peaks, "async/wait_s": self.waited_s, "async/producer_busy_s": busy}

    def held(self) -> list[Rollout]:
        """The rollouts of the batches made ahead and not yet trained on."""
        with self.changed:
            return [r for batch, _ in self.ready.values() for r in batch.rollouts]

    def quiesce(self) -> None:
        """Wait until the producer made every batch the engines' current weights feed (it then waits for the
        next push): what a checkpoint stores is then complete, and no request of this rank's is on any engine.
        Before the first batch is taken there is no producer yet, and nothing to wait for."""
        if self.thread is None:
            return
        with self.changed:
            self._wait(lambda: not self._startable())

    def state_dict(self) -> dict:
        self.quiesce()
        with self.changed:
            return {
                "version": self.version,
                "ready": {str(step): {**batch.to_dict(), "seconds": s} for step, (batch, s) in self.ready.items()},
            }

    def load_state_dict(self, state: dict) -> None:
        with self.changed:
            self.version = int(state["version"])
            self.ready = {
                int(step): (Batch.from_dict({k: v for k, v in b.items() if k != "seconds"}), b["seconds"])
                for step, b in state["ready"].items()
            }
            self.next = max(self.ready, default=self.version) + 1

    def close(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)


def rollout_schedule(
    cfg: ScheduleConfig, produce: Produce, version: int, last_step: int, barrier: Callable[[], None] | None = None
):
    """The schedule `rollout.schedule` asks for; `version`: the step whose weights the engines start with;
    `barrier` (partial placement): over every rank's main thread, for pushes with requests in flight."""
    if cfg.mode == "sync":
        return SyncSchedule(produce, version)
    staleness = 1 if cfg.mode == "one_step_off" else cfg.max_staleness
    return AheadSchedule(produce, version, staleness, last_step, resume=cfg.in_flight == "resume", barrier=barrier)


def schedule_metrics(world: World, sums: dict[str, float], peaks: dict[str, float]) -> dict[str, float]:
    """An ahead schedule's step metrics over ranks ({} for sync): mean staleness per sample, maxima."""
    if not sums:
        return {}
    total = summed(world, sums)
    mean = total["async/staleness_sum"] / max(total["async/samples"], 1.0)
    dropped, resumed = total["async/dropped_stale_samples"], total["async/resumed_samples"]
    return {
        "async/staleness_mean": mean,
        "async/dropped_stale_samples": dropped,
        "async/resumed_samples": resumed,
        **maxed(world, peaks),
    }
