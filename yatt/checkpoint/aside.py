"""Set aside, never delete at once: what a launch replaces waits in `replaced/` until that launch commits.

A launch that starts a run over replaces the run's checkpoints and its record (metrics.jsonl, samples.jsonl, ...);
one that resumes from an older checkpoint than the newest replaces the newer ones (an abandoned timeline). If it
deleted them at once, a crash of the new launch before its first checkpoint would leave nothing: the old run gone,
the new one not yet resumable. So each folder moves what is replaced into its own `replaced/<n>/` (a rename per
entry: atomic, and no copy of a checkpoint's bytes), and `drop_aside` deletes `replaced/` once the launch has
committed (yatt.controllers.run: its first complete checkpoint, or the end of a run that saves none).

A launch that crashes before committing leaves `replaced/<n>/` whole; the next launch sets its own replacements
aside in `replaced/<n+1>/` and the first commit deletes them all. Nothing in `replaced/` is read by resume: its
name matches no checkpoint pattern (yatt.checkpoint.writer), so `auto` never picks a set-aside checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from yatt.checkpoint.manifest import fsync_dir

ASIDE = "replaced"


def set_aside(folder: Path, move: Sequence[str], copy: Sequence[str] = ()) -> Path | None:
    """Move the entries `move` of `folder` (and copy the files `copy`, which the caller then rewrites) into a new
    `folder/replaced/<n>/`; that directory, or None when there was nothing to set aside."""
    move = [name for name in move if (folder / name).exists()]
    copy = [name for name in copy if (folder / name).is_file()]
    if not move and not copy:
        return None
    aside = folder / ASIDE
    taken = [int(p.name) for p in aside.iterdir() if p.name.isdigit()] if aside.is_dir() else []
    target = aside / str(max(taken, default=0) + 1)
    target.mkdir(parents=True)
    for name in copy:
        shutil.copy2(folder / name, target / name)
    for name in move:
        (folder / name).rename(target / name)
    fsync_dir(target)
    fsync_dir(folder)
    return target


def drop_aside(folder: Path) -> None:
    """Delete what earlier launches set aside in `folder` (called once the replacing launch has committed). Renamed
    away first, so a crash half-way through never leaves a partial `replaced/` that looks like a whole old run."""
    aside, doomed = folder / ASIDE, folder / f"{ASIDE}.deleting"
    if aside.is_dir():
        shutil.rmtree(doomed, ignore_errors=True)
        aside.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
