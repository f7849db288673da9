"""What a controller shard's checkpoint holds, and how a resumed shard takes it back.

A part with its own state is listed by its checkpoint key (`_stateful`); the checkpointer (yatt.checkpoint)
copies `state_dict()` at a save and hands it to `load_state_dict()` on resume. Mixed into
`yatt.controllers.shard.ControllerShard`, whose attributes it reads.
"""

from __future__ import annotations

from yatt.checkpoint.manifest import CheckpointError
from yatt.checkpoint.rng import rng_state, set_rng_state
from yatt.controllers.images import reload_images
from yatt.data.prepare import encode_prompts
from yatt.data.stream import merged


class ShardState:
    """The checkpoint side of ControllerShard."""

    @property
    def replicated(self) -> tuple[str, ...]:
        """Parts of state_dict() that are the same on every rank: a checkpoint stores them once, from rank 0
        (a trainer whose ranks hold shards of the model saves its own part on every rank instead)."""
        parts = {"trainer": self.trainer, **({"critic": self.critic.trainer} if self.critic else {})}
        return tuple(name for name, part in parts.items() if part.replicated) + ("train_stream", "ranks")

    def _stateful(self) -> dict:
        """The parts with their own state, by checkpoint key; a new stateful component adds its key here. The
        reference model is not one: it is frozen at model.path."""
        # the schedule's batches first: saving them waits until its producer is idle, so the stream and sampler
        # are settled
        ahead = self.rollouts.stateful()
        parts = {"trainer": self.trainer, "train_stream": self.train_stream, "kl_control": self.algorithm.kl_control}
        optional = {"sampler": self.sampler, "critic": self.critic}
        return {**ahead, **parts, **{key: part for key, part in optional.items() if part is not None}}

    def _restored_rollouts(self) -> list:
        """The rollouts a checkpoint carries: the batches made ahead and dynamic sampling's queued groups."""
        return self.rollouts.held() + [r for group in (self.sampler.queue if self.sampler else []) for r in group]

    def state_dict(self) -> dict[str, dict]:
        """Everything resuming needs, as named component states (live references; yatt.checkpoint copies them).
        A collective: the train streams' cursors and what a resume on another number of ranks must share out
        are gathered from every rank ("train_stream", "ranks")."""
        progress = {"step": self.last_step, "samples_trained": self.samples_trained}
        parts = {key: part.state_dict() for key, part in self._stateful().items()}
        held, trained = len(self._restored_rollouts()), self.samples_trained
        everyone = self.world.all_gather_object({"stream": parts["train_stream"], "held": held, "trained": trained})
        parts["train_stream"] = merged([r["stream"] for r in everyone])
        ranks = {"held": [r["held"] for r in everyone], "samples_trained": [r["trained"] for r in everyone]}
        return {**parts, "rng": rng_state(), "progress": progress, "ranks": ranks}

    def _reshard(self, state: dict[str, dict]) -> None:
        """A checkpoint saved by another number of ranks (yatt.checkpoint.resume.load_resharded): refuse what cannot
        be shared out again; the samples trained are spread over the new ranks, so their sum is kept."""
        ranks = state["ranks"]
        saved, trainers = len(ranks["samples_trained"]), [self.trainer] + ([self.critic.trainer] if self.critic else [])
        where = f"the checkpoint was saved by {saved} ranks and this run has {self.world.size}"
        if why := next((t.reshard_refusal for t in trainers if t.reshard_refusal), None):
            raise CheckpointError(f"{where}, but trainer.backend={self.cfg.trainer.backend} cannot resume so: {why}; "
                                  f"resume with {saved} ranks")  # fmt: skip
        if held := sum(ranks["held"]):
            raise CheckpointError(
                f"{where}, but it holds {held} rollouts made ahead or queued by dynamic sampling "
                f"on their ranks, which cannot be shared out again; resume with {saved} ranks"
            )
        total, rank, size = sum(ranks["samples_trained"]), self.world.rank, self.world.size
        state["progress"]["samples_trained"] = total // size + int(rank < total % size)

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Restore a checkpoint, then push the restored policy into the engine, which started from model.path."""
        if "ranks" in state and len(state["ranks"]["samples_trained"]) != self.world.size:
            self._reshard(state)
        for key, part in self._stateful().items():
            part.load_state_dict(state[key])
        if self.image_inputs is not None:  # batches made ahead and queued groups come back without pixels
            encode = lambda rows: encode_prompts(rows, self.tokenizer, self.cfg.data.max_prompt_tokens)  # noqa: E731
            reload_images(self._restored_rollouts(), self.image_inputs, encode)
        self.last_step, self.samples_trained = state["progress"]["step"], state["progress"]["samples_trained"]
        self.rollouts.load_weights()
        self.rollouts.version = self.last_step
        self.placement.take_metrics(), self.engine_placement.take_metrics()  # the load's timing is not a step's
        set_rng_state(state["rng"])
