"""The background checkpoint writer and the multi-rank commit protocol.

Layout of a checkpoint root:
    step-00000004/                 a complete checkpoint (manifest.json is inside, written last)
    step-00000006.tmp-<token>/     the staging dir of a save in progress, or left by a crash
    latest                         name of the newest complete checkpoint (a hint for people and tools)

One save at step k, on every rank:
  1. main thread: snapshot the state to host memory (the only stall) and hand it to the writer thread;
  2. writer thread of rank r: write its files into the staging dir, fsync them, then write
     `rank{r}.done.json` listing them with sizes and digests (atomically: write, fsync, rename);
  3. writer thread of rank 0: once every rank's done marker exists, write manifest.json, fsync, rename
     the staging dir to step-k (atomic), point `latest` at it, prune to the newest `keep`, and call `on_commit`
     (the run drops what this launch set aside: yatt.checkpoint.aside).
No collective runs on a background thread (gloo/NCCL collectives are not thread-safe against the main
thread's): the done markers on the shared file system are the barrier. The staging name carries a
token drawn once per launch, so markers left by a crashed launch can never complete a new save. A
crash at any moment leaves a complete step-k or a staging dir that resume ignores.
Every rank must see the same checkpoint root (one machine, or a shared file system across nodes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from yatt.checkpoint.manifest import (
    CheckpointError,
    describe_files,
    fsync_dir,
    fsync_file,
    write_atomic,
    write_manifest,
)
from yatt.checkpoint.snapshot import Snapshot

STEP_DIR = re.compile(r"^step-(\d{8})$")
STAGING_DIR = re.compile(r"^step-(\d{8})\.tmp-")
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class SaveJob:
    """What one rank writes for one save."""

    step: int
    parts: dict[str, Snapshot]  # file stem -> snapshot, e.g. {"rank1": ...}
    fingerprint: dict[str, Any] = field(default_factory=dict)
    export: Callable[[Path], None] | None = None  # writes an HF policy folder at the given path


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of directories named like complete checkpoints, oldest first (not verified)."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


class CheckpointWriter:
    """Writes this rank's part of each save, in a background thread (or inline when not async)."""

    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        token: str,
        keep: int,
        async_write: bool = True,
        debug_write_delay_s: float = 0.0,
        commit_timeout_s: float = 1800.0,
        on_commit: Callable[[], None] | None = None,
    ):
        self.root, self.rank, self.world_size, self.token = Path(root), rank, world_size, token
        self.keep, self.async_write, self.on_commit = keep, async_write, on_commit
        self.delay_s, self.commit_timeout_s = debug_write_delay_s, commit_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def staging_dir(self, step: int) -> Path:
        return self.root / f"{step_dir_name(step)}.tmp-{self.token}"

    def submit(self, job: SaveJob) -> None:
        """Start writing `job`; first waits for the previous save (one write in flight at a time)."""
        self.wait()
        if not self.async_write:
            self._write(job)
            return
        self._thread = threading.Thread(target=self._guarded, args=(job,), name=f"ckpt-writer-{job.step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight is written (and, on rank 0, committed); re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint write failed on rank {self.rank}: {err}") from err

    def _guarded(self, job: SaveJob) -> None:
        try:
            self._write(job)
        except BaseException as err:  # kept for wait(): a thread's exception would otherwise only be printed
            self._error = err

    def _pause(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)  # test-only fault injection (checkpoint.debug_write_delay_s)

    def _write(self, job: SaveJob) -> None:
        staging = self.staging_dir(job.step)
        staging.mkdir(parents=True, exist_ok=True)
        written = []
        for stem, snap in job.parts.items():
            tensors_path, tree_path = staging / f"{stem}.safetensors", staging / f"{stem}.json"
            save_file(snap.tensors, str(tensors_path))
            fsync_file(tensors_path)
            self._pause()
            with open(tree_path, "w", encoding="utf-8") as f:
                json.dump(snap.tree, f)
                f.flush()
                os.fsync(f.fileno())
            written += [tensors_path, tree_path]
            self._pause()
        if job.export is not None:
            job.export(staging / "policy")
            for f in (staging / "policy").rglob("*"):
                if f.is_file():
                    fsync_file(f)
            fsync_dir(staging / "policy")
            written.append(staging / "policy")
            self._pause()
        files = describe_files(staging, written)
        fsync_dir(staging)
        write_atomic(staging / f"rank{self.rank}.done.json", json.dumps(files))
        if self.rank == 0:
            self._commit(job, staging)

    def _commit(self, job: SaveJob, staging: Path) -> None:
        files: dict[str, Any] = {}
        deadline = time.monotonic() + self.commit_timeout_s
        for rank in range(self.world_size):
            marker = staging / f"rank{rank}.done.json"
            while not marker.is_file():
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"rank {rank} did not finish writing {staging.name} within {self.commit_timeout_s:.0f}s"
                    )
                time.sleep(0.02)
            files.update(json.loads(marker.read_text()))
        write_manifest(staging, job.step, self.world_size, job.fingerprint, files)
        self._pause()
        final = self.root / step_dir_name(job.step)
        if final.exists():  # left by an abandoned timeline (resumed from an older step): replace it
            remove_dir(final)
        staging.rename(final)
        fsync_dir(self.root)
        write_atomic(self.root / LATEST, final.name + "\n")
        self._prune()
        if self.on_commit is not None:  # only file-system work: no collective may run on this thread
            self.on_commit()

    def _prune(self) -> None:
        for _, old in complete_checkpoints(self.root)[: -self.keep]:
            remove_dir(old)
        point_latest(self.root)


def point_latest(root: Path) -> None:
    """After checkpoints were deleted: `latest` names the newest one left, or is removed when none is left,
    so it never names a folder that no longer exists."""
    left = complete_checkpoints(root) if root.is_dir() else []
    if left:
        if read_latest(root) != left[-1][1].name:
            write_atomic(root / LATEST, left[-1][1].name + "\n")
    else:
        (root / LATEST).unlink(missing_ok=True)


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip()
    except OSError:
        return None


def remove_dir(folder: Path) -> None:
    """Rename away first, so a crash half-way through rmtree never leaves a step-k that looks complete."""
    doomed = folder.with_name(folder.name + ".deleting")
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale(root: Path) -> list[str]:
    """Delete staging dirs and half-deleted dirs left by earlier launches (call before any save)."""
    removed = []
    for p in root.iterdir():
        if p.is_dir() and (STAGING_DIR.match(p.name) or p.name.endswith(".deleting")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed
