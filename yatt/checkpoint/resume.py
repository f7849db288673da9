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

from safetensors.torch import load_file

from yatt.checkpoint.manifest import MANIFEST, CheckpointError, fingerprint_differences, verify
from yatt.checkpoint.snapshot import restore
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
