"""A Hugging Face policy folder written from a checkpoint snapshot (checkpoint.export_hf).

It is written by the background writer from the host copy, so exporting costs no extra stall.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from yatt.checkpoint.snapshot import Snapshot

WEIGHTS_PREFIX = "trainer/model/"  # where ControllerShard.state_dict puts the policy weights


def export_hf(folder: Path, snap: Snapshot, hf_config, tokenizer) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k[len(WEIGHTS_PREFIX):]: t for k, t in snap.tensors.items() if k.startswith(WEIGHTS_PREFIX)}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
