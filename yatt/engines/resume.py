"""Requests that survive a weight update: interrupted, then resumed on the new weights (partial rollouts).

`ResumingPool` wraps an `EnginePool` for a producer that generates while a trainer pushes new weights
(rollout.schedule.in_flight: resume, docs/async.md). When `Preemption.pending()` says new weights wait, it
interrupts every request in flight (`RolloutEngine.interrupt`: each sample comes back as generated so far),
lets the push happen (`Preemption.pause`), and submits each unfinished sample again as its own request: the
prompt plus the tokens it has, for the tokens it has left, on the new weights. The finished group comes out
of `poll` once, with every sample's tokens and the engine log-probs of the weights that sampled each token,
and `Completion.versions`, the weights version of each token. A resumed sample's earlier tokens are prefilled
again on the new weights (no KV cache is kept across the push): their log-probs stay the old weights', as
the rollout IS correction needs. An MoE engine's routing (`Completion.routed_experts`, routing replay r3) is
the last forward's: the continuation's prefill routes the prompt and the earlier tokens again on the new weights,
so the routing replayed is that of one forward the engine made, the one that sampled the latest tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from yatt.engines.base import Completion
from yatt.engines.pool import EnginePool, Request


class Preemption(Protocol):
    """The producer's side of a weight push (yatt.controllers.schedule.AheadSchedule)."""

    version: int  # the weights the engines hold now

    def pending(self) -> bool:
        """New weights wait to be pushed."""
        ...

    def pause(self) -> int:
        """Let the push happen (blocks until it is done); the version the engines then hold."""
        ...


def resume_seed(seed: int | None, sample: int, generated: int) -> int | None:
    """The seed of sample `sample`'s continuation after `generated` tokens: fixed by the request's seed, so a
    resumed sample draws from a stream of its own."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"resume:{seed}:{sample}:{generated}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[list[int]] = field(default_factory=list)  # the last forward's, over prompt + tokens
    finish: str = ""  # "" while unfinished

    def extend(self, c: Completion, version: int) -> None:
        self.tokens += c.token_ids
        self.logprobs += c.logprobs
        self.versions += [version] * len(c.token_ids)
        self.routed = c.routed_experts or self.routed  # none: a queued request interrupted before its prefill
        self.finish = "" if c.finish_reason == "interrupted" else c.finish_reason

    def completion(self) -> Completion:
        return Completion(self.tokens, self.logprobs, self.finish, self.versions, self.routed)


class ResumingPool:
    """`EnginePool`'s streaming interface (submit, poll, drain, in_flight, take_metrics), with requests that
    are interrupted at a weight push and resumed on the new weights."""

    def __init__(self, pool: EnginePool, preemption: Preemption):
        self.pool, self.preemption = pool, preemption
        self.requests: dict[str, Request] = {}  # key -> the request as submitted
        self.samples: dict[str, list[_Sample]] = {}
        self.sent: dict[str, tuple[str, int, int]] = {}  # pool key -> (key, sample or -1 for all, version)
        self.interrupting = False
        self.resumes = 0  # continuation requests, for unique pool keys

    def in_flight(self) -> int:
        return len(self.samples)

    def submit(self, requests: list[Request]) -> None:
        for req in requests:
            self.requests[req.key] = req
            self.samples[req.key] = [_Sample() for _ in range(req.sampling.n)]
            self.sent[req.key] = (req.key, -1, self.preemption.version)
        self.pool.submit(requests)

    def poll(self, max_wait_s: float = 0.02) -> list[tuple[str, list[Completion]]]:
        """Groups whose every sample finished since the last call, each key once."""
        if self.preemption.pending() and self.pool.in_flight() and not self.interrupting:
            self.pool.interrupt()
            self.interrupting = True
        out = []
        for sent_key, completions in self.pool.poll(max_wait_s):
            key, sample, version = self.sent.pop(sent_key)
            for j, c in zip(range(len(completions)) if sample < 0 else [sample], completions):
                self.samples[key][j].extend(c, version)
            if all(s.finish for s in self.samples[key]):
                out.append((key, [s.completion() for s in self.samples.pop(key)]))
                del self.requests[key]
        if self.pool.in_flight() == 0 and self.samples and (self.interrupting or self.preemption.pending()):
            self._resume(self.preemption.pause())
        return out

    def _resume(self, version: int) -> None:
        """Submit every unfinished sample again, from where it stopped, on the weights `version`."""
        self.interrupting, again = False, []
        for key, samples in self.samples.items():
            req = self.requests[key]
            for j, s in enumerate(samples):
                if len(s.tokens) >= req.sampling.max_tokens:  # interrupted as it reached the limit
                    s.finish = s.finish or "length"
                if s.finish:
                    continue
                self.resumes += 1
                sent_key = f"{key}~{self.resumes}"
                self.sent[sent_key] = (key, j, version)
                sampling = replace(req.sampling, n=1, max_tokens=req.sampling.max_tokens - len(s.tokens))
                seed = resume_seed(req.seed if req.seed is None else req.seed + j, j, len(s.tokens))
                again.append(Request(sent_key, req.prompt + s.tokens, seed, sampling, req.images))
        self.pool.submit(again)

    def drain(self, on_result: Callable[[str, list[Completion]], None] | None = None) -> dict[str, list[Completion]]:
        """Poll until every submitted group is back."""
        results: dict[str, list[Completion]] = {}
        while self.in_flight():
            for key, completions in self.poll(0.1):
                results[key] = completions
                if on_result:
                    on_result(key, completions)
        return results

    def take_metrics(self, prefix: str) -> dict[str, float]:
        return self.pool.take_metrics(prefix)
