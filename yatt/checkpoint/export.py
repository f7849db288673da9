"""A Hugging Face policy folder (safetensors + config + tokenizer) that transformers and vLLM load.

checkpoint.export_hf writes one inside each checkpoint. `policy_writer` is the hook a save calls on every rank,
in the training thread; it chooses where the weights come from and returns what rank 0's background writer
runs, so the folder lands in the checkpoint's staging directory and appears only at the commit. A trainer with
LoRA adapters (model.lora) also writes them, as peft's adapter folder, in the policy folder's `adapter/`.

Weights are written as safetensors files of about SHARD_BYTES each (Hugging Face's index names them when there
are several), one file at a time as the weights come: a sharded trainer's are gathered as they are written, so
no rank ever holds the whole policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from safetensors.torch import save_file
from torch import Tensor

from yatt.checkpoint.snapshot import Snapshot, restore
from yatt.tensors import weight_buckets

PolicyWriter = Callable[[Path], None]  # writes the policy folder at the given path (background writer, rank 0)
ADAPTER_DIR = "adapter"  # model.lora: peft's adapter folder inside the policy folder
SHARD_BYTES = 1 << 30  # an export's safetensors files: what its writer holds at a time (a larger layer: one file)
INDEX = "model.safetensors.index.json"


class PolicySource(Protocol):
    """What the export needs of a trainer (yatt.trainers.base.Trainer has it all)."""

    replicated: bool
    hf_config: Any

    def hf_weights(self, state: dict[str, Any]) -> dict[str, Tensor]: ...
    def stream_hf_weights(self) -> Iterable[tuple[str, Tensor]]: ...
    def gather_adapter(self) -> dict[str, Any] | None: ...
    def save_adapter(self, folder: Path, state: dict[str, Any] | None = None) -> None:
        """peft's adapter folder of a snapshot's state (None: live); nothing for a trainer without adapters."""


def write_weights(folder: Path | None, named: Iterable[tuple[str, Tensor]]) -> None:
    """`named` (Hugging Face names, a decoder layer's weights one after the other) as the safetensors files of a
    policy folder, one file of about SHARD_BYTES at a time, never splitting a layer. With a sharded trainer's
    `stream_hf_weights` this is a collective: every rank calls it and reads `named` to the end, and the one given
    a `folder` (rank 0) writes."""
    if folder is None:
        for _ in named:  # the gathers happen as the stream is read
            pass
        return
    folder.mkdir(parents=True, exist_ok=True)
    files: list[tuple[str, list[str]]] = []
    total = 0
    for bucket in weight_buckets(named, SHARD_BYTES):
        name = f"model-{len(files) + 1:05d}.safetensors"
        tensors = {k: t.detach().cpu().contiguous() for k, t in bucket}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        files.append((name, list(tensors)))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(files) == 1:  # one file: the name transformers and vLLM look for first, no index
        (folder / files[0][0]).rename(folder / "model.safetensors")
        return
    weight_map = {}
    for i, (name, keys) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (folder / name).rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))


def write_config(folder: Path, hf_config: Any, tokenizer: Any) -> None:
    hf_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def export_hf(folder: Path, weights: dict[str, Tensor], hf_config: Any, tokenizer: Any) -> None:
    """`weights` under Hugging Face names, e.g. from a checkpoint's host copy (checkpoint.export_hf), which
    the background writer exports so that it costs training no extra stall."""
    write_weights(folder, weights.items())
    write_config(folder, hf_config, tokenizer)


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


def policy_writer(
    trainer: PolicySource, snap: Snapshot | None, folder: Path | None, key: str, tokenizer: Any
) -> PolicyWriter | None:
    """The export hook of one save, called on every rank (`snap`: rank 0's snapshot of the replicated state,
    `folder`: the policy folder in the save's staging dir; None on the other ranks); what this rank's background
    writer runs, or None (every rank but 0).

    A replicated trainer's weights are already in rank 0's snapshot under `key`: the writer maps them to HF
    names, at no extra stall. A sharded trainer (FSDP2, TP/PP) holds a slice per rank, so its weights are
    gathered now, while the process group may still be used (collectives never run on the writer thread), and
    rank 0 writes them into `folder` file by file as they come (the stall pays the write, but no rank holds the
    whole policy); the writer adds the config, tokenizer and adapters (gathered now too: they are small)."""
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
    write_weights(folder, trainer.stream_hf_weights())  # collectives: every rank takes part, rank 0 writes
    adapter = trainer.gather_adapter()
    if folder is None:
        return None
    return partial(export_rest, adapter=adapter, trainer=trainer, tokenizer=tokenizer)


def export_rest(folder: Path, adapter: Any, trainer: PolicySource, tokenizer: Any) -> None:
    """What a sharded trainer's export writes after its weights: the config, tokenizer and, with LoRA, adapters."""
    write_config(folder, trainer.hf_config, tokenizer)
    if adapter is not None:
        trainer.save_adapter(folder / ADAPTER_DIR, adapter)
