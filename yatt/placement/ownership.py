"""One device, one owner. Handing the device to another role offloads the old owner and onloads the
new one; every switch is timed so the cost of a placement mode shows in the metrics.

On CPU nothing is really freed (vLLM has no sleep mode there, and trainer tensors already live in
host memory): the hooks report what they would free, and ownership decides who computes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol


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
    """Tracks the owner of this rank's device; `with own("rollout"): ...` runs a stage as that role."""

    def __init__(self, roles: dict[str, Role], initial_owner: str | None = None):
        self.roles = roles
        self.owner = initial_owner
        self.switch_seconds = 0.0
        self.switches = 0
        self.stage_seconds: dict[str, float] = {}

    def acquire(self, role: str) -> None:
        if role not in self.roles:
            raise KeyError(f"unknown role {role!r}; roles on this device: {sorted(self.roles)}")
        if role == self.owner:
            return
        start = time.perf_counter()
        if self.owner is not None:
            self.roles[self.owner].offload()
        self.roles[role].onload()
        self.owner = role
        self.switch_seconds += time.perf_counter() - start
        self.switches += 1

    @contextmanager
    def own(self, role: str) -> Iterator[None]:
        self.acquire(role)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_seconds[role] = self.stage_seconds.get(role, 0.0) + time.perf_counter() - start

    def take_metrics(self) -> dict[str, float]:
        """Time per role and switch cost since the last call (then reset)."""
        out = {f"time/{role}_s": s for role, s in self.stage_seconds.items()}
        out["placement/switch_s"] = self.switch_seconds
        out["placement/switches"] = float(self.switches)
        self.stage_seconds, self.switch_seconds, self.switches = {}, 0.0, 0
        return out
