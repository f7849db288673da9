"""What a controller shard's checkpoint holds, and how a resumed shard takes it back.

A part with its own state is listed by its checkpoint key (`_stateful`); the checkpointer (yatt.checkpoint)
copies `state_dict()` at a save and hands it to `load_state_dict()` on resume. Mixed into
`yatt.controllers.shard.ControllerShard`, whose attributes it reads.
"""

from __future__ import annotations

from yatt.checkpoint.rng import rng_state, set_rng_state
from yatt.controllers.images import reload_images
from yatt.data.prepare import encode_prompts


class ShardState:
    """The checkpoint side of ControllerShard."""

    @property
    def replicated(self) -> tuple[str, ...]:
        """Parts of state_dict() that are the same on every rank: a checkpoint stores them once, from rank 0
        (a trainer whose ranks hold shards of the model saves its own part on every rank instead)."""
        parts = {"trainer": self.trainer, **({"critic": self.critic.trainer} if self.critic else {})}
        return tuple(name for name, part in parts.items() if part.replicated)

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
        """Everything resuming needs, as named component states (live references; yatt.checkpoint copies them)."""
        progress = {"step": self.last_step, "samples_trained": self.samples_trained}
        parts = {key: part.state_dict() for key, part in self._stateful().items()}
        return {**parts, "rng": rng_state(), "progress": progress}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Restore a checkpoint, then push the restored policy into the engine, which started from model.path."""
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
