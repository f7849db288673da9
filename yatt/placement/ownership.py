"""One device, one owner. Handing the device to another role offloads the old owner and onloads the
new one; every switch is timed so the cost of a placement mode shows in the metrics.

On CPU nothing is really freed (vLLM has no sleep mode there, and trainer tensors already live in
host memory): the hooks report what they would free, and ownership decides who computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol


class Role(Protocol):
    def offload(self) -> dict: ...
    def onload(self) -> dict: ...


class HookRole:
    """A role made of two callables, e.g. an engine's sleep/wake."""

    def __init__(self, offload: Callable[[], dict], onload: Callable[[], dict]):
        self._offload, self._onload = offload, onload

    def offload(self) -> dict:
        return self._offload()

    def onload(self) -> dict:
        return self._onload()


class DeviceOwnership:
    """Tracks the owner of this rank's device; `with own("rollout"): ...` runs a stage as that role.

    Time is charged to whoever owns the device, from the moment it got it until the next switch,
    so the metrics say how long the device served each role (busy or waiting on other devices).
    """

    def __init__(self, roles: dict[str, Role], initial_owner: str | None = None):
        self.roles = roles
        self.owner = initial_owner
        self.since = time.perf_counter()
        self.switch_seconds = 0.0
        self.switches = 0
        self.freed_bytes = 0  # accelerator memory the offloads reported freeing (0 on CPU)
        self.owned_seconds: dict[str, float] = {}

    def _charge(self, now: float) -> None:
        if self.owner is not None:
            self.owned_seconds[self.owner] = self.owned_seconds.get(self.owner, 0.0) + now - self.since
        self.since = now

    def acquire(self, role: str) -> None:
        if role not in self.roles:
            raise KeyError(f"unknown role {role!r}; roles on this device: {sorted(self.roles)}")
        if role == self.owner:
            return
        start = time.perf_counter()
        self._charge(start)
        if self.owner is not None:
            report = self.roles[self.owner].offload()
            reports = report if isinstance(report, list) else [report]  # a role may be several engines
            self.freed_bytes += sum(int(r.get("freed_bytes", 0)) for r in reports if isinstance(r, dict))
        self.roles[role].onload()
        self.owner = role
        self.since = time.perf_counter()
        self.switch_seconds += self.since - start
        self.switches += 1

    @contextmanager
    def own(self, role: str) -> Iterator[None]:
        self.acquire(role)
        yield

    def take_metrics(self) -> dict[str, float]:
        """Seconds owned per role and switch cost since the last call (then reset)."""
        self._charge(time.perf_counter())
        out = {f"placement/owned_{role}_s": s for role, s in self.owned_seconds.items()}
        out["placement/switch_s"] = self.switch_seconds
        out["placement/switches"] = float(self.switches)
        out["placement/offload_freed_bytes"] = float(self.freed_bytes)
        self.owned_seconds, self.switch_seconds, self.switches, self.freed_bytes = {}, 0.0, 0, 0
        return out
