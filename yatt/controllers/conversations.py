"""Agent conversations on a rank's rollout engines: G conversations per prompt, all driven at once.

`ConversationPool` has `EnginePool`'s streaming interface (submit, poll, drain, in_flight, take_metrics), so the
generation phase (yatt.controllers.generation), the evaluation and ReMax's baselines run an agent loop
(rollout.agent, yatt.agents) where they would send one request per prompt. A submitted request (a prompt, its
seed, `n` = G) starts G conversations; `poll` returns the request's key with its G `Trajectory`s once all G
have ended. `agent_rollouts` turns those into rollouts, checking what a loop hands back.

How they run: one thread per conversation runs the loop's blocking `run` unchanged (a user's loop is plain
sequential code, and a tool that blocks, e.g. the python sandbox's subprocess, blocks only its own
conversation). A turn's `Generate` call queues one request (n=1, the turn's seed and max_tokens) and waits for
its key; the caller's thread, the only one that touches the engine pool, sends every queued turn at each poll
and hands each completion back to its waiting thread. So an engine sees the turns of all conversations at
once, and a dead engine's turns are re-routed by the pool like any request. With `lockstep` (rollout.agent) the
turns wait for each other: they are sent once no conversation is running its loop's code or waiting for a
completion, all in one call in key order, so the engines batch the same turns together in every run. Each turn's
prompt is the trajectory's own ids (token in, token out: no history is re-tokenized).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from yatt.agents import build_loop
from yatt.agents.base import AgentLoop, TokenizerCodec, Trajectory, row_kwargs
from yatt.agents.config import AgentConfig
from yatt.balance.exchange import FINISH_REASONS
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow
from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.pool import EnginePool, Request
from yatt.engines.resume import ResumingPool

AGENT_STATS = ("num_turns", "tool_calls", "malformed_tool_calls", "tool_errors")


def conversation_seed(seed: int | None, sample: int) -> int | None:
    """The seed of a prompt's `sample`-th conversation (its first turn's; yatt.agents.base.turn_seed the rest)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"conversation:{seed}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class _Turn:
    """One model turn a conversation thread waits on."""

    request: Request
    done: threading.Event = field(default_factory=threading.Event)
    completion: Completion | None = None


@dataclass
class _Group:
    """A submitted request's G conversations."""

    request: Request
    trajectories: list[Trajectory | None]
    left: int


@dataclass(frozen=True)
class Agent:
    """The run's agent loop and how its turns reach the engines (the rollout.agent section)."""

    loop: AgentLoop
    lockstep: bool = False

    @classmethod
    def build(cls, cfg: AgentConfig, tokenizer) -> Agent:
        return cls(build_loop(cfg, TokenizerCodec(tokenizer)), cfg.lockstep)

    @property
    def multi_turn(self) -> bool:
        """Whether samples are conversations of several calls (anything but a one-call loop: single_turn)."""
        return not getattr(self.loop, "one_call", False)

    def pool(
        self, engines: EnginePool | ResumingPool, rows: dict[str, PromptRow] | None = None
    ) -> EnginePool | ResumingPool | ConversationPool:
        """Where this loop's samples go: a conversation pool running the loop per sample, or, for a one-call loop
        (AgentLoop.one_call), the engines themselves, which run that one call for a prompt's G samples at once.
        `rows`: each request key's prompt row, handed to a loop that takes it (AgentLoop.takes_row)."""
        return ConversationPool(engines, self.loop, self.lockstep, rows) if self.multi_turn else engines


class ConversationPool:
    def __init__(
        self,
        pool: EnginePool | ResumingPool,
        loop: AgentLoop,
        lockstep: bool = False,
        rows: dict[str, PromptRow] | None = None,
    ):
        self.pool, self.loop, self.lockstep = pool, loop, lockstep
        self.rows = rows or {}  # request key -> its prompt row, for a loop that takes it (AgentLoop.takes_row)
        self.held: list[_Turn] = []  # lockstep: the round's turns ready so far
        self.running = 0  # conversations in their loop's code (not waiting for a turn, not ended), as events tell
        self.groups: dict[str, _Group] = {}
        self.waiting: dict[str, _Turn] = {}  # pool key -> the turn waiting for it (caller's thread only)
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # _Turn to send, or (group key, sample, result)
        self.specs: dict[tuple[int, int], SamplingSpec] = {}  # one spec per (request spec, max_tokens): batched sends
        self.lock = threading.Lock()

    @property
    def max_queue(self) -> int:
        return self.pool.max_queue

    def in_flight(self) -> int:
        return len(self.groups)

    def submit(self, requests: list[Request]) -> None:
        for req in requests:
            if req.images:
                raise ValueError(f"request {req.key!r}: agent loops take text prompts only (it has images)")
            if req.key in self.groups:
                raise ValueError(f"request key {req.key!r} was already submitted to this pool")
            n = req.sampling.n
            self.groups[req.key] = _Group(req, [None] * n, n)
            self.running += n
            for j in range(n):
                threading.Thread(target=self._converse, args=(req, j), daemon=True, name=f"agent {req.key}/{j}").start()

    def _turn_spec(self, spec: SamplingSpec, max_tokens: int) -> SamplingSpec:
        with self.lock:
            key = (id(spec), max_tokens)
            if key not in self.specs:
                self.specs[key] = replace(spec, n=1, max_tokens=max_tokens)
            return self.specs[key]

    def _converse(self, req: Request, sample: int) -> None:
        """A conversation thread: the loop's `run`, its turns sent through the caller's thread."""
        turns: list[_Turn] = []

        def generate(prompt_ids: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float], str]:
            key = f"{req.key}/c{sample}/t{len(turns)}"
            turn = _Turn(Request(key, list(prompt_ids), seed, self._turn_spec(req.sampling, max_tokens)))
            turns.append(turn)
            self.events.put(turn)
            turn.done.wait()
            c = turn.completion
            return list(c.token_ids), list(c.logprobs) if c.logprobs else [0.0] * len(c.token_ids), c.finish_reason

        try:
            result = self.loop.run(
                list(req.prompt),
                generate,
                req.sampling.max_tokens,
                conversation_seed(req.seed, sample),
                **row_kwargs(self.loop, self.rows.get(req.key)),
            )
            if turns and turns[-1].completion.routed_experts:
                result.routed_experts = last_turn_routing(result, turns[-1].request.prompt, turns[-1].completion)
        except BaseException as e:  # handed to the caller's thread, which raises it
            result = e
        self.events.put((req.key, sample, result))

    def poll(self, max_wait_s: float = 0.02) -> list[tuple[str, list[Trajectory]]]:
        """Groups whose G conversations all ended since the last call, each key once. Sends the turns queued
        meanwhile and hands back the completions that arrived."""
        out: list[tuple[str, list[Trajectory]]] = []
        events = self._events(0.0 if self.pool.in_flight() else max_wait_s)
        self.running -= len(events)  # each event is a conversation that stopped running: a turn or its end
        self.held += [e for e in events if isinstance(e, _Turn)]
        if self.held and not (self.lockstep and (self.running or self.pool.in_flight())):
            turns = sorted(self.held, key=lambda t: t.request.key) if self.lockstep else self.held
            for turn in turns:
                self.waiting[turn.request.key] = turn
            self.pool.submit([t.request for t in turns])
            self.held = []
        if self.pool.in_flight():
            for key, completions in self.pool.poll(max_wait_s):
                turn = self.waiting.pop(key)
                turn.completion = completions[0]
                self.running += 1
                turn.done.set()
        for event in events:
            if isinstance(event, _Turn):
                continue
            key, sample, result = event
            group = self.groups[key]
            if isinstance(result, BaseException):
                raise RuntimeError(
                    f"agent loop {type(self.loop).__name__} failed on {key}/{sample}: {result!r}"
                ) from result
            group.trajectories[sample] = result
            group.left -= 1
            if not group.left:
                out.append((key, self.groups.pop(key).trajectories))
        return out

    def _events(self, wait_s: float) -> list:
        """Everything the conversation threads queued, waiting up to `wait_s` for the first when none is there."""
        events = []
        try:
            events.append(self.events.get(timeout=wait_s) if wait_s > 0 else self.events.get_nowait())
            while True:
                events.append(self.events.get_nowait())
        except queue.Empty:
            return events

    def drain(
        self, on_result: Callable[[str, list[Trajectory]], None] | None = None, timeout_s: float | None = None
    ) -> dict[str, list[Trajectory]]:
        """Poll until every conversation has ended."""
        results: dict[str, list[Trajectory]] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.in_flight():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.in_flight()} conversation groups still running after {timeout_s}s")
            for key, trajectories in self.poll(0.1):
                results[key] = trajectories
                if on_result:
                    on_result(key, trajectories)
        return results

    def take_metrics(self, prefix: str) -> dict[str, float]:
        return self.pool.take_metrics(prefix)


def last_turn_routing(t: Trajectory, prompt: list[int], last: Completion) -> list[list[int]]:
    """A conversation's MoE routing (routing replay r3): its last turn's forward, which prefilled every earlier
    id (the turn's prompt is the trajectory so far: token in, token out), then -1 (the trainer's router) for
    environment ids after it. So the routing replayed is that of one forward the engine made."""
    ids, seen = t.prompt_ids + t.response_ids, prompt + last.token_ids
    if ids[: len(seen)] != seen:
        raise ValueError(
            "routing replay r3: the last turn's prompt and completion are not the start of the trajectory's ids "
            "(a loop that re-tokenizes the history), so its routing cannot be replayed; use routing_replay=r2"
        )
    return last.routed_experts + [[-1] * len(last.routed_experts[0])] * (len(ids) - len(seen))


def agent_rollouts(row: PromptRow, prompt_ids: list[int], trajectories: list[Trajectory]) -> list[Rollout]:
    """One prompt's rollouts from its conversations: the whole response (model and environment tokens, with the
    mask), the engine's log-probs of the model tokens (0.0 under mask 0), the last model turn as the text the
    reward reads, the loop's counts and the environment's own reward when it set one. What a loop hands back is
    checked here, naming the rule it breaks."""
    out = []
    for t in trajectories:
        n = len(t.response_ids)
        if list(t.prompt_ids) != list(prompt_ids):
            raise ValueError("an agent loop's trajectory does not start with the prompt's ids (token in, token out)")
        if len(t.response_mask) != n or len(t.rollout_logprobs) != n:
            raise ValueError(
                f"an agent loop's trajectory has {n} response ids, {len(t.response_mask)} mask entries and "
                f"{len(t.rollout_logprobs)} log-probs; Trajectory.append keeps them aligned"
            )
        if set(t.response_mask) - {0, 1}:
            raise ValueError("an agent loop's response mask holds values other than 0 and 1")
        if t.finish_reason not in FINISH_REASONS:
            raise ValueError(f"an agent loop's finish_reason {t.finish_reason!r} is none of {FINISH_REASONS}")
        out.append(
            Rollout(
                row,
                list(prompt_ids),
                list(t.response_ids),
                [lp if m else 0.0 for lp, m in zip(t.rollout_logprobs, t.response_mask)],
                t.finish_reason,
                text=t.final_text,
                response_mask=list(t.response_mask),
                routed_experts=t.routed_experts,
                agent_stats={name: float(getattr(t, name)) for name in AGENT_STATS},
                env_reward=t.reward,
                env_scores=dict(t.scores),
            )
        )
    return out
