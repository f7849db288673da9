"""One episode of a verifiers environment's own protocol, `Env.run(task, agents)`, with yatt playing the model.

An environment's `run` opens `agents.<name>.interaction(task)` and sends user turns with `await
interaction.turn(message)`; each is answered by one model turn (a `Segment`), and the outcome is recorded on
`interaction.trace` (`record_reward`). verifiers' own agent answers through a harness program (a subprocess per
turn) and an HTTP model server. Here the environment's agent is a `ModelSeat`, built by verifiers' public agent
factory (`vf.Agents(config, make)`), whose interaction hands each turn to `play(message) -> reply | None`: the
caller (yatt.agents.environment) generates the reply on yatt's engines and keeps the token ids; None ends the
exchange (a terminated Segment, as when a verifiers agent hits its limits). No harness, no HTTP.

The episode's reward is what the environment recorded, score x weight summed (verifiers' `Trace.reward`).

TextArena seeds Python's global RNG in `run` before its first turn, so an episode in another thread could draw
from it between the seed and the game's reset: an episode's setup (from the start of `run` to its first
interaction) runs under `SETUP_LOCK`, one at a time in the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from yatt.envs import require_verifiers

Play = Callable[[str | None], str | None]  # the user turn (None: the task's prompt opens) -> reply, None: end

SETUP_LOCK = threading.Lock()


class EpisodeRecord:
    """What the environment records on its interaction's `trace`: rewards, metrics, info (a verifiers Trace's
    recording surface; the token ids stay with the caller)."""

    def __init__(self) -> None:
        self.rewards: dict[str, Any] = {}
        self.metrics: dict[str, float | None] = {}
        self.info: dict[str, Any] = {}

    def record_reward(self, name: str, value: float, weight: float = 1.0) -> None:
        self.rewards[name] = require_verifiers().Reward(score=float(value), weight=float(weight))

    def record_metric(self, name: str, value: float) -> None:
        self.metrics[name] = float(value)

    def record_metrics(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.record_metric(name, value)

    @property
    def reward(self) -> float:
        return sum(r.value for r in self.rewards.values() if r is not None)


class ModelInteraction:
    """`Interaction.turn` for one exchange: a user message in, the model's reply as a Segment out."""

    def __init__(self, play: Play) -> None:
        self.play, self.trace, self.over = play, EpisodeRecord(), False

    async def turn(self, message: Any = None) -> Any:
        vf = require_verifiers()
        if self.over:
            raise RuntimeError("the exchange is over (the model's side ended it); read interaction.trace")
        reply = self.play(_text(message))
        if reply is None:
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        return vf.Segment(messages=[vf.AssistantMessage(content=reply)])


class ModelSeat:
    """The environment's agent: one interaction per episode, its first call ending the setup's lock."""

    def __init__(self, play: Play, setup_done: Callable[[], None]) -> None:
        self.play, self.setup_done = play, setup_done
        self.interaction_: ModelInteraction | None = None

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **kwargs: Any):
        if self.interaction_ is not None:
            raise RuntimeError("the environment opened a second interaction in one episode; yatt plays one")
        self.setup_done()
        self.interaction_ = ModelInteraction(self.play)
        yield self.interaction_


def run_episode(env: Any, task: Any, play: Play) -> EpisodeRecord:
    """Run `env`'s protocol on `task` to its end in this thread (its own event loop), `play` answering each
    turn; the record of what the environment scored. Raises what the environment raises."""
    vf = require_verifiers()
    held = [SETUP_LOCK.acquire()]

    def setup_done() -> None:
        if held[0]:
            held[0] = False
            SETUP_LOCK.release()

    seat = ModelSeat(play, setup_done)

    async def episode() -> None:
        agents = vf.Agents(env.config, lambda name, spec: seat)
        await env.setup(agents)
        await env.run(task, agents)

    try:
        asyncio.run(episode())
    finally:
        setup_done()
    if seat.interaction_ is None:
        raise RuntimeError(f"{type(env).__name__}.run() played no turn")
    return seat.interaction_.trace


def _text(message: Any) -> str | None:
    """A turn's message as text: a string, or the text of its messages (dicts or verifiers messages)."""
    if message is None or isinstance(message, str):
        return message
    parts = []
    for m in message:
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if not isinstance(content, str):
            raise ValueError("the environment sent a turn that is not text; yatt plays text turns only")
        parts.append(content)
    return "\n\n".join(parts)
