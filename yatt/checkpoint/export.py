"""A Hugging Face policy folder (safetensors + config + tokenizer) that transformers and vLLM load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from yatt.checkpoint.snapshot import Snapshot, restore


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
) -> None:
    """Export the state saved under `key` of a checkpoint snapshot; `hf_weights` (the trainer's) finds the
    Hugging Face-named weights in it."""
    state = restore({key: snap.tree[key]}, snap.tensors)[key]
    export_hf(folder, hf_weights(state), hf_config, tokenizer)
