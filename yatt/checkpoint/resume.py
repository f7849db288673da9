"""Choosing and reading the checkpoint to resume from.

`--resume auto` takes the newest checkpoint that verifies against its manifest; staging dirs (a save
that never finished) and corrupted checkpoints are skipped with a warning saying why. `--resume PATH`
takes exactly that checkpoint (or, for a checkpoint root, the newest good one in it) and fails loudly
if it is not complete. `--resume none` starts fresh.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from yatt.checkpoint.manifest import MANIFEST, CheckpointError, fingerprint_differences, verify
from yatt.checkpoint.snapshot import chunk_rows, restore
from yatt.checkpoint.writer import STAGING_DIR, STEP_DIR


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped during resume."""


def _candidates(root: Path) -> list[tuple[int, bool, Path]]:
    """(step, complete-by-name, dir), newest first; at equal steps the complete one first."""
    out = []
    for p in root.iterdir() if root.is_dir() else []:
        if not p.is_dir():
            continue
        if m := STEP_DIR.match(p.name):
            out.append((int(m.group(1)), True, p))
        elif m := STAGING_DIR.match(p.name):
            out.append((int(m.group(1)), False, p))
    return sorted(out, key=lambda c: (c[0], c[1]), reverse=True)


def newest_complete(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint under `root` that verifies, warning about each newer one it skips."""
    for _, complete, folder in _candidates(Path(root)):
        if not complete:
            warnings.warn(
                f"skipping partial checkpoint {folder} (its write never finished)", CheckpointWarning, stacklevel=2
            )
            continue
        try:
            return folder, verify(folder)
        except CheckpointError as err:
            warnings.warn(f"skipping checkpoint: {err}", CheckpointWarning, stacklevel=2)
    return None


def find_resume(root: Path, mode: str) -> tuple[Path, dict[str, Any]] | None:
    """(checkpoint dir, manifest) to resume from, or None to start fresh. mode: auto | none | PATH."""
    if mode == "none":
        return None
    if mode == "auto":
        return newest_complete(Path(root))
    path = Path(mode)
    if not path.is_dir():
        raise CheckpointError(f"--resume {mode}: no such checkpoint directory")
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name) or STAGING_DIR.match(path.name):
        return path, verify(path)
    found = newest_complete(path)
    if found is None:
        raise CheckpointError(f"--resume {mode}: no complete checkpoint in this directory")
    return found


def check_compatible(folder: Path, manifest: dict[str, Any], fingerprint: dict[str, Any]) -> None:
    """Refuse a checkpoint written under a config whose fingerprinted fields differ from this one."""
    diffs = fingerprint_differences(manifest["fingerprint"], fingerprint)
    if diffs:
        raise CheckpointError(
            f"checkpoint {folder} was written by an incompatible config; these fields must "
            f"match to resume: {'; '.join(diffs)}; use another run.name, or --resume none "
            "--overwrite to start this run over"
        )


def load_part(folder: Path, stem: str) -> dict[str, Any]:
    """Component states of one file pair (stem.safetensors + stem.json) of a checkpoint."""
    tensors = load_file(str(folder / f"{stem}.safetensors"))
    tree = json.loads((folder / f"{stem}.json").read_text())
    return restore(tree, tensors)


class _SavedRanks:
    """The tensors of every saved rank's file, opened lazily: a dim-0 shard (yatt.checkpoint.snapshot) is read as
    the rows rank `rank` of `world` holds, slice by slice from the files that have them, so no rank reads a
    whole sharded tensor; any other tensor comes from saved rank `source`."""

    def __init__(self, folder: Path, saved_world: int, source: int, rank: int, world: int):
        self.files = [safe_open(str(folder / f"rank{i}.safetensors"), "pt") for i in range(saved_world)]
        self.source, self.rank, self.world = source, rank, world

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.files[self.source].get_tensor(name)

    def rows(self, name: str, total: int) -> torch.Tensor:
        start, end = chunk_rows(total, self.rank, self.world)
        pieces = []
        for i, file in enumerate(self.files):
            lo, hi = chunk_rows(total, i, len(self.files))
            if max(lo, start) < min(hi, end):
                pieces.append(file.get_slice(name)[max(lo, start) - lo : min(hi, end) - lo])
        return torch.cat(pieces) if pieces else self.files[0].get_slice(name)[0:0]


def load_resharded(folder: Path, saved_world: int, rank: int, world: int) -> dict[str, Any]:
    """Rank `rank` of `world`'s component states from a checkpoint saved by `saved_world` ranks: every dim-0 shard
    cut again for this rank, the rest as saved rank `rank % saved_world` had it. Which parts may be taken this way
    is the resumed component's to decide (yatt.controllers.shard_state)."""
    source = rank % saved_world
    tree = json.loads((folder / f"rank{source}.json").read_text())
    return restore(tree, _SavedRanks(folder, saved_world, source, rank, world))
