"""Delta weight sync (`rollout.engine.delta_sync`): send an engine only the tensors it does not already hold.

Read `HeldWeights`. Each `EngineClient` keeps one: the version (yatt.tensors.WeightVersions, numbered by the
trainer) of every tensor its engine acknowledged, i.e. whose `update_weights` RPC returned. A tensor is left out of
a sync when the engine acknowledged its current version, so it holds those bytes already; nothing is assumed about
an engine the client has not updated (it started from model.path, perhaps in another dtype), so a new client, and
with it a restarted engine, gets everything. A tensor is forgotten before the RPC that carries it and recorded only
after the engine answered, so a failed update leaves nothing recorded that the engine may not hold (and the engine
exits on a failed update anyway: yatt.engines.server).

Tensors go in whole units (`sync_unit`): every tensor of a module (a module's weight and bias, an adapted module's
LoRA A, B and scaling, an MoE layer's experts), and every member of a group of modules an engine fuses (vLLM's
q/k/v and gate/up: yatt.models.lora.FUSED), because vLLM reloads a fused module only whole. If one tensor of a unit
changed, the whole unit is sent.
"""

from __future__ import annotations

from collections.abc import Callable

from yatt.models.lora import FUSED
from yatt.tensors import NamedTensors

Versions = Callable[[str], int | None]  # yatt.tensors.WeightVersions


def sync_unit(name: str) -> str:
    """The unit a tensor is sent with (module docstring): its module, or its fused group of modules."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for group in FUSED:
        if leaf in group:
            return f"{parent}.{'+'.join(group)}"
    return module


class HeldWeights:
    """What one engine holds, by tensor name and version (module docstring)."""

    def __init__(self) -> None:
        self.versions: dict[str, int] = {}

    def held(self, named: NamedTensors, versions: Versions) -> set[str]:
        """The names of `named` that need not be sent: every tensor of their unit is held at its current version."""
        stale = {sync_unit(n) for n, _ in named if (v := versions(n)) is None or self.versions.get(n) != v}
        return {n for n, _ in named if sync_unit(n) not in stale}

    def sending(self, names: list[str]) -> None:
        """These are about to be sent: until the engine answers, it may hold neither the old nor the new bytes."""
        for name in names:
            self.versions.pop(name, None)

    def acknowledged(self, names: list[str], versions: Versions | None) -> None:
        """The engine applied these (at `versions`; None: versions unknown, nothing is recorded)."""
        if versions is None:
            return
        for name in names:
            if (v := versions(name)) is not None:
                self.versions[name] = v
