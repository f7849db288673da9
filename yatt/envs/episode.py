"""One episode of a verifiers environment's own protocol, `Env.run(task, agents)`, with yatt playing the model.

An environment's `run` either hands the task to its agent (`await agents.<name>.run(task)`: verifiers'
`SingleAgentEnv`, one reply to the task's prompt) or opens `agents.<name>.interaction(task)` and sends user turns
with `await interaction.turn(message)` (e.g. TextArena's game loop); each turn is answered by one model turn (a
`Segment`). verifiers' own agent answers through a harness program (a subprocess per turn) and an HTTP model
server. Here the environment's agent is a `ModelSeat`, built by verifiers' public agent factory
(`vf.Agents(config, make)`), which hands each turn to `play(message) -> reply | None`: the caller
(yatt.agents.environment) generates the reply on yatt's engines and keeps the token ids; None ends the exchange (a
terminated Segment, as when a verifiers agent hits its limits). No harness, no HTTP.

The seat keeps a real verifiers `Trace` of the exchange, as a verifiers rollout does: the task's prompt, the
model's replies (sampled nodes) and the environment's messages, as messages (the token ids stay with the caller).
Before each model turn the task's `@stop` functions read it (one firing ends the exchange), and when the exchange
closes the task scores it with its own `@reward` and `@metric` functions (`Task.score`), as verifiers' rollout does
at its close; the environment can also record rewards on it in `run`. The episode's reward is the trace's: score
x weight, summed (`Trace.reward`).

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
CAPPED = "yatt_cap"  # the trace's stop condition when the loop ended it (max_turns or the token cap)


def new_trace(task: Any, agent: Any) -> Any:
    """An empty verifiers Trace of `task` played by the agent declared as `agent` (its AgentConfig)."""
    vf = require_verifiers()
    from verifiers.v1.state import state_cls

    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=vf.AgentInfo(config=agent),
    )


def add_message(trace: Any, message: Any, sampled: bool = False) -> None:
    """Append one message to the trace's single branch (`sampled`: the model wrote it)."""
    vf = require_verifiers()
    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))


class ModelInteraction:
    """`Interaction.turn` for one exchange: a user message in, the model's reply as a Segment out."""

    def __init__(self, play: Play, task: Any, agent: Any) -> None:
        self.play, self.task, self.over, self.started = play, task, False, False
        self.trace = new_trace(task, agent)
        self.stops = task.hooks("stop")  # each reads the trace (yatt.envs.verifiers_env.check_task)

    async def turn(self, message: Any = None) -> Any:
        vf = require_verifiers()
        if self.over:
            raise RuntimeError("the exchange is over (the model's side ended it); read interaction.trace")
        if not self.started:
            self.started = True
            for m in prompt_messages(self.task.data):
                add_message(self.trace, m)
        if message is not None:
            from verifiers.v1.dialects.chat import parse_message

            for m in [vf.UserMessage(content=message)] if isinstance(message, str) else message:
                add_message(self.trace, parse_message(m) if isinstance(m, dict) else m)
        if await self.stopped():
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        reply = self.play(_text(message))
        if reply is None:
            self.over = True
            self.trace.stop(CAPPED)
            return vf.Segment(messages=[], terminated=True)
        answer = vf.AssistantMessage(content=reply)
        add_message(self.trace, answer, sampled=True)
        return vf.Segment(messages=[answer])

    async def stopped(self) -> bool:
        """Run the task's @stop functions before a model turn, as verifiers does; the first that fires is the
        trace's stop condition."""
        from verifiers.v1.session import call_hook

        for fn in self.stops:
            result = await call_hook(fn, {require_verifiers().Trace: self.trace})
            if not isinstance(result, bool):
                raise ValueError(
                    f"task {type(self.task).__name__}: @stop {fn.__name__} returned {result!r}, not a bool"
                )
            if result:
                self.trace.stop(fn.__name__)
                return True
        return False


class ModelSeat:
    """The environment's agent: one exchange per episode (`run` or `interaction`), its opening ending the setup's
    lock and its close scored by the task."""

    def __init__(self, play: Play, agent: Any, setup_done: Callable[[], None]) -> None:
        self.play, self.agent, self.setup_done = play, agent, setup_done
        self.interaction_: ModelInteraction | None = None

    async def run(self, task: Any, **kwargs: Any) -> Any:
        """verifiers' `Agent.run`: the model answers the task's prompt once, and the task scores the trace."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **kwargs: Any):
        if self.interaction_ is not None:
            raise RuntimeError("the environment opened a second interaction in one episode; yatt plays one")
        self.setup_done()
        self.interaction_ = interaction = ModelInteraction(self.play, task, self.agent)
        yield interaction
        interaction.over = True
        interaction.trace.stop("user_closed")  # kept if a stop or the cap came first
        await task.score(interaction.trace)  # no runtime: tasks whose scoring needs one are refused up front


def run_episode(env: Any, task: Any, play: Play) -> Any:
    """Run `env`'s protocol on `task` to its end in this thread (its own event loop), `play` answering each
    turn; the verifiers Trace of the exchange, scored. Raises what the environment raises."""
    vf = require_verifiers()
    held = [SETUP_LOCK.acquire()]

    def setup_done() -> None:
        if held[0]:
            held[0] = False
            SETUP_LOCK.release()

    seats: list[ModelSeat] = []

    def make(name: str, spec: Any) -> ModelSeat:
        seats.append(ModelSeat(play, spec, setup_done))
        return seats[-1]

    async def episode() -> None:
        agents = vf.Agents(env.config, make)
        await env.setup(agents)
        await env.run(task, agents)

    try:
        asyncio.run(episode())
    finally:
        setup_done()
    if not seats or seats[0].interaction_ is None:
        raise RuntimeError(f"{type(env).__name__}.run() played no turn")
    return seats[0].interaction_.trace


def named_scores(trace: Any) -> dict[str, float]:
    """The trace's named scores, for metrics: each reward's unweighted score (`reward/<name>`) and each metric
    (`metric/<name>`), from the task's functions and what the environment recorded; None (not scored) left out."""
    rewards = {f"reward/{k}": r.score for k, r in trace.rewards.items() if r is not None}
    return rewards | {f"metric/{k}": float(v) for k, v in trace.metrics.items() if v is not None}


def prompt_messages(data: Any) -> list[Any]:
    """The task's opening messages as verifiers sends them: its system prompt, then its prompt."""
    vf = require_verifiers()
    messages = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(data.prompt)
    return messages


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
