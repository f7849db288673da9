"""What a controller shard's checkpoint holds, and how a resumed shard takes it back.

`ShardCheckpoint` is what yatt.checkpoint saves and loads for a shard (its `Stateful` protocol): the parts with
their own state, listed by checkpoint key when the shard builds it (a new stateful component adds its key
there), the schedule's batches made ahead, the shard's `Progress`, and the rng. The checkpointer copies
`state_dict()` at a save and hands it to `load_state_dict()` on resume. The reference model is no part: it is
frozen at model.path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from yatt.checkpoint.manifest import CheckpointError
from yatt.checkpoint.rng import rng_state, set_rng_state
from yatt.data.stream import merged
from yatt.distributed import World


@dataclass
class Progress:
    step: int = 0  # the last step trained
    samples_trained: int = 0  # by this rank since the run began (dynamic sampling and balancing vary it)


class ShardCheckpoint:
    """`parts`: checkpoint key -> a part with state_dict()/load_state_dict() (None: absent in this run);
    `trainers`: the keys whose part holds a model -> its trainer, whose `replicated` and `reshard_refusal` say
    how a checkpoint holds it; `schedule`: the rollout schedule (yatt.controllers.schedule), whose batches made
    ahead are parts too, and which pushes the restored policy into the engines after a load; `reload_images`:
    gives restored rollouts their pixels back (None: text prompts)."""

    def __init__(
        self,
        world: World,
        progress: Progress,
        schedule: Any,
        parts: dict[str, Any],
        trainers: dict[str, Any],
        reload_images: Callable[[list], None] | None,
        backend: str,
    ):
        self.world, self.progress, self.schedule, self.backend = world, progress, schedule, backend
        self.parts = {key: part for key, part in parts.items() if part is not None}
        self.trainers = {key: t for key, t in trainers.items() if t is not None}
        self.reload_images = reload_images

    @property
    def replicated(self) -> tuple[str, ...]:
        """Parts of state_dict() that are the same on every rank: a checkpoint stores them once, from rank 0
        (a trainer whose ranks hold shards of the model saves its own part on every rank instead)."""
        return tuple(key for key, t in self.trainers.items() if t.replicated) + ("train_stream", "ranks")

    def _stateful(self) -> dict:
        # the schedule's batches first: saving them waits until its producer is idle, so the stream and sampler
        # are settled
        return {**self.schedule.stateful(), **self.parts}

    def _restored_rollouts(self) -> list:
        """The rollouts a checkpoint carries: the batches made ahead and dynamic sampling's queued groups."""
        queued = self.parts["sampler"].queue if "sampler" in self.parts else []
        return self.schedule.held() + [r for group in queued for r in group]

    def state_dict(self) -> dict[str, dict]:
        """Everything resuming needs, as named component states (live references; yatt.checkpoint copies them).
        A collective: the train streams' cursors and what a resume on another number of ranks must share out
        are gathered from every rank ("train_stream", "ranks")."""
        progress = {"step": self.progress.step, "samples_trained": self.progress.samples_trained}
        parts = {key: part.state_dict() for key, part in self._stateful().items()}
        held, trained = len(self._restored_rollouts()), self.progress.samples_trained
        everyone = self.world.all_gather_object({"stream": parts["train_stream"], "held": held, "trained": trained})
        parts["train_stream"] = merged([r["stream"] for r in everyone])
        ranks = {"held": [r["held"] for r in everyone], "samples_trained": [r["trained"] for r in everyone]}
        return {**parts, "rng": rng_state(), "progress": progress, "ranks": ranks}

    def _reshard(self, state: dict[str, dict]) -> None:
        """A checkpoint saved by another number of ranks (yatt.checkpoint.resume.load_resharded): refuse what cannot
        be shared out again; the samples trained are spread over the new ranks, so their sum is kept."""
        ranks = state["ranks"]
        saved = len(ranks["samples_trained"])
        where = f"the checkpoint was saved by {saved} ranks and this run has {self.world.size}"
        if why := next((t.reshard_refusal for t in self.trainers.values() if t.reshard_refusal), None):
            raise CheckpointError(f"{where}, but trainer.backend={self.backend} cannot resume so: {why}; "
                                  f"resume with {saved} ranks")  # fmt: skip
        if held := sum(ranks["held"]):
            raise CheckpointError(
                f"{where}, but it holds {held} rollouts made ahead or queued by dynamic sampling "
                f"on their ranks, which cannot be shared out again; resume with {saved} ranks"
            )
        total, rank, size = sum(ranks["samples_trained"]), self.world.rank, self.world.size
        state["progress"]["samples_trained"] = total // size + int(rank < total % size)

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Restore a checkpoint, then push the restored policy into the engines, which started from model.path."""
        if "ranks" in state and len(state["ranks"]["samples_trained"]) != self.world.size:
            self._reshard(state)
        for key, part in self._stateful().items():
            part.load_state_dict(state[key])
        if self.reload_images is not None:  # batches made ahead and queued groups come back without pixels
            self.reload_images(self._restored_rollouts())
        self.progress.step, self.progress.samples_trained = (
            state["progress"]["step"],
            state["progress"]["samples_trained"],
        )
        self.schedule.load_weights()
        self.schedule.version = self.progress.step
        where = self.schedule.where
        where.placement.take_metrics(), where.engine_placement.take_metrics()  # the load's timing is not a step's
        set_rng_state(state["rng"])
