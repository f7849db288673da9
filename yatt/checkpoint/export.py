"""A Hugging Face policy folder (safetensors + config + tokenizer) that transformers and vLLM load.

checkpoint.export_hf writes one inside each checkpoint. `policy_writer` is the hook a save calls on every rank,
in the training thread; it chooses where the weights come from and returns what rank 0's background writer
runs, so the folder lands in the checkpoint's staging directory and appears only at the commit. A trainer with
LoRA adapters (model.lora) also writes them, as peft's adapter folder, in the policy folder's `adapter/`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from safetensors.torch import save_file
from torch import Tensor

from yatt.checkpoint.snapshot import Snapshot, restore

PolicyWriter = Callable[[Path], None]  # writes the policy folder at the given path (background writer, rank 0)
ADAPTER_DIR = "adapter"  # model.lora: peft's adapter folder inside the policy folder


class PolicySource(Protocol):
    """What the export needs of a trainer (yatt.trainers.base.Trainer has it all)."""

    replicated: bool
    hf_config: Any

    def hf_weights(self, state: dict[str, Any]) -> dict[str, Tensor]: ...
    def gather_hf_weights(self) -> dict[str, Tensor] | None: ...
    def gather_adapter(self) -> dict[str, Any] | None: ...
    def save_adapter(self, folder: Path, state: dict[str, Any] | None = None) -> None:
        """peft's adapter folder of a snapshot's state (None: live); nothing for a trainer without adapters."""


def export_hf(folder: Path, weights: dict[str, Tensor], hf_config: Any, tokenizer: Any) -> None:
    """`weights` under Hugging Face names, e.g. from a checkpoint's host copy (checkpoint.export_hf), which
    the background writer exports so that it costs training no extra stall."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: t.contiguous() for k, t in weights.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    hf_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def export_snapshot(
    folder: Path,
    snap: Snapshot,
    key: str,
    hf_weights: Callable[[Any], dict[str, Tensor]],
    hf_config: Any,
    tokenizer: Any,
    save_adapter: Callable[[Path, Any], None],
) -> None:
    """Export the state saved under `key` of a checkpoint snapshot; `hf_weights` (the trainer's) finds the
    Hugging Face-named weights in it, `save_adapter` (the trainer's) writes its adapters, if it has any."""
    state = restore({key: snap.tree[key]}, snap.tensors)[key]
    export_hf(folder, hf_weights(state), hf_config, tokenizer)
    save_adapter(folder / ADAPTER_DIR, state)


def policy_writer(trainer: PolicySource, snap: Snapshot | None, key: str, tokenizer: Any) -> PolicyWriter | None:
    """The export hook of one save, called on every rank (`snap`: rank 0's snapshot of the replicated state,
    None on the other ranks); what this rank's background writer runs, or None (every rank but 0).

    A replicated trainer's weights are already in rank 0's snapshot under `key`: the writer maps them to HF
    names, at no extra stall. A sharded trainer (TP/PP) holds a slice per rank, so its weights are gathered
    now, while the process group may still be used (collectives never run on the writer thread): a host copy
    on rank 0, which training may go on past while the writer writes it."""
    if trainer.replicated:
        if snap is None:
            return None
        return partial(
            export_snapshot,
            snap=snap,
            key=key,
            hf_weights=trainer.hf_weights,
            hf_config=trainer.hf_config,
            tokenizer=tokenizer,
            save_adapter=trainer.save_adapter,
        )
    weights = trainer.gather_hf_weights()  # collectives: every rank takes part, rank 0 gets the copies
    adapter = trainer.gather_adapter()
    if weights is None:
        return None
    return partial(export_gathered, weights=weights, adapter=adapter, trainer=trainer, tokenizer=tokenizer)


def export_gathered(
    folder: Path, weights: dict[str, Tensor], adapter: Any, trainer: PolicySource, tokenizer: Any
) -> None:
    """A sharded trainer's gathered host copies written as the export: the weights and, with LoRA, the adapters."""
    export_hf(folder, weights, trainer.hf_config, tokenizer)
    if adapter is not None:
        trainer.save_adapter(folder / ADAPTER_DIR, adapter)
