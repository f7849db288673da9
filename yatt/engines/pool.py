"""Streaming requests over several engines: least-loaded routing, and re-routing when one dies.

A request is (key, prompt, seed) with a key unique within the pool's life; its result comes back
from `poll` exactly once, however many engines it was sent to: when an engine dies, its
unanswered requests go to a live engine (or a respawned one), and a late duplicate is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.client import EngineClient, EngineDied


@dataclass
class Request:
    key: str
    prompt: list[int]
    seed: int | None
    sampling: SamplingSpec
    images: list[bytes] | None = None  # encoded images, one per placeholder token of `prompt` (yatt.data.images)


class NoLiveEngine(RuntimeError):
    """Every engine of the pool is dead and none could be respawned."""


class EnginePool:
    def __init__(self, engines: dict[str, EngineClient], respawn: Callable[[str], EngineClient] | None = None):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = dict(engines)
        self.respawn = respawn
        self.pending: dict[str, dict[str, Request]] = {name: {} for name in engines}
        self.reported_load = {name: 0 for name in engines}  # requests in flight from all clients, last seen
        self.answered: set[str] = set()
        self.rerouted = self.respawned = self.duplicates = 0
        self.max_queue = 0

    def in_flight(self) -> int:
        return sum(len(p) for p in self.pending.values())

    def _least_loaded(self, extra: dict[str, int]) -> str:
        return min(self.engines, key=lambda n: (max(self.reported_load[n], len(self.pending[n])) + extra[n], n))

    def submit(self, requests: list[Request]) -> None:
        """Route each request to the engine with the fewest requests in flight, then send per engine."""
        extra = {name: 0 for name in self.engines}
        routed: dict[str, list[Request]] = {}
        for req in requests:
            if req.key in self.answered or any(req.key in p for p in self.pending.values()):
                raise ValueError(f"request key {req.key!r} was already submitted to this pool")
            name = self._least_loaded(extra)
            extra[name] += req.sampling.n
            routed.setdefault(name, []).append(req)
        for name, reqs in routed.items():
            self._send(name, reqs)
        self.max_queue = max(self.max_queue, self.in_flight())

    def _send(self, name: str, reqs: list[Request]) -> None:
        by_sampling: dict[int, list[Request]] = {}
        for r in reqs:  # one submit per distinct sampling spec (normally just one)
            by_sampling.setdefault(id(r.sampling), []).append(r)
        for group in by_sampling.values():
            self.pending[name].update({r.key: r for r in group})
            seeds = None if any(r.seed is None for r in group) else [r.seed for r in group]
            images = [r.images for r in group] if any(r.images for r in group) else None
            try:
                self.reported_load[name] = self.engines[name].submit(
                    [r.key for r in group],
                    [r.prompt for r in group],
                    group[0].sampling,
                    seeds,
                    **({"images": images} if images is not None else {}),
                )
            except EngineDied:
                self._replace(name)
                return

    def poll(self, max_wait_s: float = 0.02) -> list[tuple[str, list[Completion]]]:
        """Results that arrived since the last call, each key once."""
        out: list[tuple[str, list[Completion]]] = []
        busy = [n for n in self.engines if self.pending[n]]
        for name in busy:
            try:
                done, _, load = self.engines[name].poll(max_wait_s / len(busy))
            except EngineDied:
                self._replace(name)
                continue
            self.reported_load[name] = load
            for key, completions in done:
                if key in self.answered or self.pending[name].pop(key, None) is None:
                    self.duplicates += 1  # answered already (e.g. by the engine it was re-routed to)
                    continue
                self.answered.add(key)
                out.append((key, completions))
        return out

    def interrupt(self) -> None:
        """End every request in flight early: each comes back from `poll` as generated so far ("interrupted")."""
        for name in [n for n in self.engines if self.pending[n]]:
            try:
                self.engines[name].interrupt()
            except EngineDied:
                self._replace(name)  # its requests go again, whole, to a live engine

    def drain(
        self, on_result: Callable[[str, list[Completion]], None] | None = None, timeout_s: float | None = None
    ) -> dict[str, list[Completion]]:
        """Poll until nothing is in flight."""
        results: dict[str, list[Completion]] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.in_flight():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.in_flight()} requests still in flight after {timeout_s}s")
            for key, completions in self.poll(0.1):
                results[key] = completions
                if on_result:
                    on_result(key, completions)
        return results

    def _replace(self, dead: str) -> None:
        """Re-route a dead engine's unanswered requests; respawn it if no engine is left."""
        orphans = list(self.pending.pop(dead).values())
        engine = self.engines.pop(dead)
        self.reported_load.pop(dead, None)
        engine.close()
        if not self.engines:
            if self.respawn is None:
                raise NoLiveEngine(f"engine {dead!r} died and the pool has no other engine")
            self.engines[dead] = self.respawn(dead)
            self.pending[dead], self.reported_load[dead] = {}, 0
            self.respawned += 1
        self.rerouted += len(orphans)
        if orphans:
            self.submit(orphans)

    def take_metrics(self, prefix: str) -> dict[str, float]:
        out = {
            f"{prefix}/rerouted": float(self.rerouted),
            f"{prefix}/respawned": float(self.respawned),
            f"{prefix}/duplicates_dropped": float(self.duplicates),
            f"{prefix}/max_queue": float(self.max_queue),
        }
        self.rerouted = self.respawned = self.duplicates = self.max_queue = 0
        self.answered.clear()
        return out

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
