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

import abc
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from yatt.config import ExperimentConfig
from yatt.controllers.generation import GenerationStats, GroupShare
from yatt.controllers.metrics import StageTimer
from yatt.data.rollout import Rollout
from yatt.distributed import World, model_parallel_world, own_group
from yatt.placement.engine_lifecycle import EngineServices
from yatt.placement.metrics import engine_busy, maxed, step_placement_metrics, summed
from yatt.placement.ownership import DeviceOwnership, HookRole
from yatt.placement.plan import GenerationSchedule, GenerationSplit

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


def batches(produce: Callable, engines: EngineServices, heal: Callable[[], int]) -> Produce:
    """A schedule's Produce from the shard's `produce(step, timer)` (its rollouts, generation stats and dynamic
    sampling counts): `heal` the engines first (sync: all ranks together; ahead of the trainer, on the producer
    thread: this rank's own, without collectives), note the engines' time and the weights version."""

    def batch(step: int, timer: StageTimer, version: int) -> Batch:
        restarted, before = heal(), engines.busy_seconds()
        rollouts, stats, counts = produce(step, timer)
        for r in rollouts:  # groups dynamic sampling kept from an earlier batch keep their own version
            r.version = version if r.version < 0 else r.version
        return Batch(rollouts, stats, counts, engine_busy(before, engines.busy_seconds()), restarted)

    return batch


@dataclass
class Where:
    """The devices a schedule makes its batches on, as `build_schedule` sets them up for `rollout.schedule` and
    `placement.mode` (None in the unit tests of a schedule's timing)."""

    engines: EngineServices
    placement: DeviceOwnership  # the main thread's: owns "train" (sync: the engines' roles too)
    engine_placement: DeviceOwnership  # the engines' roles (sync: the same object)
    group: GroupShare  # the producer's model-parallel share of a batch's prompts
    world: World  # every rank's device
    devices: World  # the devices whose engines serve each other's batches (partial placement: barriers)
    splits: GenerationSchedule  # partial placement: which devices generate and which judge, chosen from load

    @property
    def partial(self) -> bool:
        """placement.mode == partial: every rank's batch is generated on every rank's engines."""
        return self.splits.split is not None


class RolloutSchedule(abc.ABC):
    """What the shard asks of `rollout.schedule`, whichever it is; sync is the trivial case.

    `take` a step's batch, made by `produce` (on the caller's thread, or ahead on a producer thread); `push` the
    new weights; the engines' healing, the partial placement barriers around a batch, the push itself and the
    wait before an evaluation are the schedule's, so the shard never asks which schedule it has."""

    where: Where | None
    engines: contextlib.AbstractContextManager  # held around every use of the engines
    version: int  # the step whose weights the engines hold

    @abc.abstractmethod
    def take(self, step: int, timer: StageTimer) -> Batch:
        """Step `step`'s batch (its generate/reward seconds go to `timer`)."""

    @abc.abstractmethod
    def settled(self, step: int) -> int:
        """The last step every rank has finished when batch `step` starts."""

    @abc.abstractmethod
    def push(self, step: int, push: Callable[[], None]) -> None:
        """Run `push` (step `step`'s weights to the engines) when the schedule lets the engines go."""

    def released(self) -> contextlib.AbstractContextManager:
        """Around a wait on other ranks on the producer's side: lets go of the engines meanwhile where needed."""
        return contextlib.nullcontext()

    def held(self) -> list[Rollout]:
        """The rollouts of batches made and not yet trained on."""
        return []

    def metrics(self, step: int, rollouts: list[Rollout]) -> tuple[dict[str, float], dict[str, float]]:
        """This rank's (to sum over ranks, to max over ranks) schedule metrics of the step."""
        return {}, {}

    def stateful(self) -> dict:
        """The parts of the schedule a checkpoint holds, by key."""
        return {}

    def close(self) -> None:
        return  # sync: no producer to stop

    # ---- on the devices of `where` ---------------------------------------------------------------
    def batch_started(self) -> None:
        """On the producer's side, before a batch's first request."""
        return  # sync: the batch is made with the weights this rank just pushed

    def batch_made(self, timer: StageTimer) -> None:
        """Partial placement: a device keeps serving the others until every controller's batch is made."""
        if self.where.partial:
            with timer("generate"), self.released():
                self.where.devices.barrier()

    def push_weights(self, step: int) -> None:
        """Step `step`'s weights to the rollout engines, when the schedule lets them go."""
        self.push(step, self.load_weights)

    def load_weights(self) -> None:
        """Push the trainer's weights into the rollout engines now (a resumed run's, too)."""
        with self.where.engine_placement.own("rollout"):
            self.where.engines.push_policy()

    def before_evaluation(self) -> None:
        """Before the held-out evaluation uses the engines."""
        return  # sync: no request of this rank's is in flight between steps

    def split(self, step: int) -> GenerationSplit | None:
        """The generation split batch `step` is made with (None: full placement), the same on every rank."""
        return self.where.splits.split_for(self.settled(step))

    def placement_metrics(
        self, data: World, step: int, batch: Batch, timer: StageTimer, judges, teacher: bool = False
    ) -> dict[str, float]:
        """Per-device time per role and idle fraction, judge throughput and queue (step_placement_metrics; sums
        over `data`, the data-parallel ranks); looks restarted engines up again, and picks the next step's split.
        `teacher`: the run serves a distillation teacher (its engines' pool metrics). sync/sent_mb and
        sync/skipped_mb: what the step's weight syncs sent every device's rollout engines and left out (the delta
        sync: what they held already)."""
        where = self.where
        busy = {**batch.busy, "train": timer.seconds["logprobs"] + timer.seconds["update"]}
        restarts, owned = where.engines.take_restarts(), where.placement.take_metrics()
        parts = (busy, owned, restarts, batch.restarted, batch.stats, self.split(step), timer.total, judges)
        out = step_placement_metrics(data, where.world, *parts, batch.rollouts, teacher=teacher)
        synced = where.engines.take_synced()  # every device's rollout engines: MB the weight syncs sent, left out
        out.update(summed(where.world, {f"sync/{k.partition('_')[0]}_mb": v / 2**20 for k, v in synced.items()}))
        if out["placement/engine_restarts"]:
            with self.engines:
                where.engines.forget_endpoints()
        # every rank saw the same sums, so all choose the same split for the next step
        where.splits.observe(out["load/rollout_busy_s"], out["load/genrm_busy_s"], step)
        return out


class SyncSchedule(RolloutSchedule):
    """Generate, then train, then push: the step's batch is produced when the step asks for it."""

    def __init__(self, produce: Produce, version: int, where: Where | None = None):
        self.produce, self.version, self.where = produce, version, where
        self.engines = contextlib.nullcontext()

    def take(self, step: int, timer: StageTimer) -> Batch:
        return self.produce(step, timer, self.version)

    def settled(self, step: int) -> int:
        """The one before it."""
        return step - 1

    def push(self, step: int, push: Callable[[], None]) -> None:
        push()
        self.version = step


class AheadSchedule(RolloutSchedule):
    """one_step_off / async: a producer thread keeps up to `staleness` batches ahead of the trainer."""

    def __init__(
        self,
        produce: Produce,
        version: int,
        staleness: int,
        last_step: int,
        resume: bool = False,
        barrier: Callable[[], None] | None = None,
        where: Where | None = None,
    ):
        self.produce, self.staleness, self.last, self.barrier = produce, staleness, last_step, barrier
        self.where = where
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

    def stateful(self) -> dict:
        return {"rollouts": self}  # the batches made ahead: saving them waits until the producer is idle

    def batch_started(self) -> None:
        """Partial placement: every rank has pushed the weights this batch is made with (the ranks' engines
        serve each other)."""
        if self.where.partial:
            with self.released():
                self.where.devices.barrier()

    def load_weights(self) -> None:
        if self.barrier is not None and self.where.engine_placement.owner != "rollout":
            # partial, in flight resume: this device judges for the others while their requests may be in flight:
            # its judges stay awake, and its rollout engines load these weights when the device next rolls out
            # (EngineServices.catch_up)
            self.where.engines.push_policy(load=False)
            return
        super().load_weights()

    def before_evaluation(self) -> None:
        """Partial: this device's engines serve the other ranks' producers, and evaluating switches it to
        rollout (on a GPU its judges sleep). Once every producer has made the batches the current weights feed
        (the ranks' batches end together, at a barrier), none has a request on any engine, and none starts one
        before the next push."""
        if self.where.partial:
            self.quiesce()

    def close(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)


def build_schedule(
    cfg: ExperimentConfig,
    produce: Callable,
    engines: EngineServices,
    train: HookRole,
    devices: World,
    data: World,
    group_world: World | None,
) -> RolloutSchedule:
    """The schedule `rollout.schedule` asks for, on its devices. `train`: what the trainer's side owns (its
    offload/onload hooks); `devices`: every rank (engines, placement); `data`: the data-parallel view;
    `group_world`: the ranks of this rank's model-parallel group (None: the rank holds the whole model);
    `produce(step, timer)`: a step's rollouts, generation stats and dynamic sampling counts (`batches`).
    The engines start with the weights of step 0."""
    roles, sched, partial = engines.device_roles(), cfg.rollout.schedule, cfg.placement.mode == "partial"
    splits = GenerationSchedule(cfg.placement, devices.size)
    if sched.mode == "sync":  # one thread: the devices switch between the trainer and the engines' roles
        placement = DeviceOwnership({"train": train, **roles}, "rollout")
        group = GroupShare(group_world, devices, data)
        where = Where(engines, placement, placement, group, devices, devices, splits)
        return SyncSchedule(batches(produce, engines, engines.heal), 0, where)
    # a producer thread generates on the engines' own devices, with its own process groups so that its
    # collectives never interleave with the trainer's
    engines.keep_pushed()  # a restarted engine gets the version its batch is generated with
    own = model_parallel_world(devices, *cfg.trainer.model_parallel) if group_world else None
    placement, engine_placement = DeviceOwnership({"train": train}, "train"), DeviceOwnership(roles, "rollout")
    producers = own_group(devices) if partial else devices
    where = Where(engines, placement, engine_placement, GroupShare(own, devices, data), devices, producers, splits)
    resume = sched.in_flight == "resume"
    # partial: every rank's producer uses every rank's engines, so a push with requests in flight is made by
    # all ranks at once; a device that judges for the others keeps its rollout engines asleep meanwhile
    barrier = data.barrier if resume and partial else None
    staleness = 1 if sched.mode == "one_step_off" else sched.max_staleness
    produce = batches(produce, engines, engines.heal_local)
    schedule = AheadSchedule(produce, 0, staleness, cfg.run.steps, resume, barrier, where)
    if resume:  # requests in flight at a push resume on the new weights
        engines.preemption = schedule
    return schedule


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
