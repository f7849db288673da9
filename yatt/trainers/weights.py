"""What trains of a loaded policy module, and how its weights leave the trainer: the seam a model transform fills.

The torch trainer's model chain (yatt.trainers.torch_trainer: load -> freeze -> weights -> checkpointing -> data
parallel -> optimizer) asks one `Weights` object, chosen once when the module is built, everything that differs
between training every weight and training LoRA adapters: the optimizer's parameters, the weights under Hugging
Face names (export, sync), what engines reload and the versions of those (the delta sync), the checkpoint's piece
(under `key`), an export's extra files, and a reference model for free. `FullWeights` is the default;
`yatt.trainers.lora.Adapters` is LoRA. The trainer never asks which one it holds. `WeightChanges` is the trainer's
record of which parameters changed when, which `Weights.versions` reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from yatt.tensors import NamedTensors
from yatt.trainers.sharding import full, local

# what a checkpoint's weights piece holds, by its key (for the error when a checkpoint and the config disagree)
HOLDS = {"model": "all weights", "adapter": "LoRA adapters"}


class WeightChanges:
    """When each trained parameter last changed, as a count of the trainer's changes: what a delta sync compares
    (yatt.tensors.WeightVersions, yatt.engines.delta).

    The trainer calls `stepped` after each optimizer step it takes (a step skipped for a non-finite gradient norm
    changes nothing) and `all_changed` whenever weights are written otherwise (a checkpoint load). `stepped` marks
    the parameters that had a gradient: AdamW leaves a parameter without one untouched, bit for bit (and a frozen
    one is never in the optimizer). Anything else that writes a trained parameter must call `all_changed`, or an
    engine keeps the old bytes."""

    def __init__(self) -> None:
        self.count = 0
        self.changed: dict[Tensor, int] = {}  # parameter -> the count at its last change
        self.everything = 0  # the count at the last `all_changed`

    def stepped(self, params: Iterable[Tensor]) -> None:
        self.count += 1
        for p in params:
            if p.grad is not None:
                self.changed[p] = self.count

    def all_changed(self) -> None:
        self.count += 1
        self.everything = self.count

    def of(self, p: Tensor) -> int:
        """The version of `p`: 0 for one never changed (as loaded)."""
        return max(self.changed.get(p, 0), self.everything)


class Weights(Protocol):
    key: str  # the checkpoint key of `state()`: "model" (every weight) or "adapter" (LoRA)

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer trains, in a fixed order."""
        ...

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        """The whole policy under Hugging Face names, one weight at a time (a sharded one gathered as it comes:
        every rank iterates it to the end)."""
        ...

    def hf_weights(self, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The whole policy under Hugging Face names, of a snapshot's `state` (None: live)."""
        ...

    def engine_weights(self) -> NamedTensors:
        """What the weight sync sends (engines keep the rest)."""
        ...

    def versions(self, changes: WeightChanges) -> dict[str, int]:
        """Per name `engine_weights` gives, a version that changes whenever that tensor may have (from `changes`):
        what a delta sync compares. Names only, nothing gathered."""
        ...

    def state(self) -> dict[str, Tensor]:
        """Live references to what a checkpoint holds of the weights."""
        ...

    def load_state(self, state: dict[str, Tensor]) -> None: ...

    def save_adapter(self, folder: str | Path, state: dict[str, Tensor] | None = None, write: bool = True) -> None:
        """An export's adapter folder of a snapshot's `state` (None: live, gathered with fsdp2: every rank calls it
        and the one with `write` writes); nothing when there are no adapters."""
        ...

    def host_adapters(self) -> dict[str, Tensor] | None:
        """A host copy of what `state()` holds of the adapters, whole (gathered with fsdp2: every rank calls it):
        what `save_adapter` takes as `state` off the training thread; None when there are no adapters."""
        ...

    def save_hf(self, folder: str | Path, tokenizer: Any) -> None:
        """The policy as a Hugging Face folder (weights, config, generation config, tokenizer)."""
        ...

    def reference(self, trainer: Any) -> Any | None:
        """A frozen reference model for free (LoRA: `trainer` with its adapter off), or None: load one."""
        ...


class FullWeights:
    """Every weight trains but the frozen ones (e.g. a vision tower, model.freeze_vision), which engines never
    reload since they never change."""

    key = "model"

    def __init__(self, module: nn.Module, frozen: set[str]):
        self.module, self.frozen = module, frozen

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Parameters under their Hugging Face names, detached (tied weights once); with fsdp2 each gathered when
        it is reached (yatt.trainers.sharding), so a consumer that frees them holds one at a time."""
        for name, p in self.module.named_parameters():
            yield name, full(p.detach())

    def hf_weights(self, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        return dict(self.named_weights() if state is None else state)

    def engine_weights(self) -> Iterator[tuple[str, Tensor]]:
        return ((n, t) for n, t in self.named_weights() if n not in self.frozen)

    def versions(self, changes: WeightChanges) -> dict[str, int]:
        return {n: changes.of(p) for n, p in self.module.named_parameters() if n not in self.frozen}

    def state(self) -> dict[str, Tensor]:
        """Live references to the weights: with fsdp2 DTensors, which a checkpoint saves as this rank's rows."""
        return {name: p.detach() for name, p in self.module.named_parameters()}

    @torch.no_grad()
    def load_state(self, state: dict[str, Tensor]) -> None:
        params = dict(self.module.named_parameters())
        if set(params) != set(state):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise ValueError(f"checkpoint weights do not fit this model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, p in params.items():
            local(p).copy_(local(state[name]))

    def save_adapter(self, folder: str | Path, state: dict[str, Tensor] | None = None, write: bool = True) -> None:
        """No adapters: the policy folder is the weights alone."""

    def host_adapters(self) -> None:
        return None

    def save_hf(self, folder: str | Path, tokenizer: Any) -> None:
        self.module.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))

    def reference(self, trainer: Any) -> None:
        """None: the reference is a frozen copy, loaded by the caller."""
        return None
