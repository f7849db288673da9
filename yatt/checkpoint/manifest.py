"""Manifests: what makes a checkpoint directory complete, and how to prove it.

`manifest.json` is the last file written into a checkpoint. It lists every other file with its size
and blake2b digest, plus the step, world size, format version and the config fingerprint. A
directory without a readable manifest, or with any file missing, resized or altered, is not a
checkpoint: `verify` says why, and resume skips it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 8 << 20


class CheckpointError(Exception):
    """A checkpoint that cannot be used (missing, incomplete, corrupted, or from another config), or a run directory
    whose checkpoints a launch may not replace. `quiet`: raised on a rank that only learned it from rank 0 (which
    reports it), so the launcher prints it once."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a directory's entries live in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so readers see the old content or the new one, never a torn file."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def describe_files(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, blake2b}} for files (folders are walked) under `root`."""
    out = {}
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            out[f.relative_to(root).as_posix()] = {"bytes": f.stat().st_size, "blake2b": file_digest(f)}
    return out


def write_manifest(
    folder: Path, step: int, world_size: int, fingerprint: dict[str, Any], files: dict[str, dict[str, Any]]
) -> None:
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "fingerprint": fingerprint,
        "files": files,
    }
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (the write did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}: unreadable {MANIFEST} ({err})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{folder}: format version {manifest.get('format_version')}, this yatt reads {FORMAT_VERSION}"
        )
    return manifest


def verify(folder: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; CheckpointError naming the first problem otherwise."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for rel, meta in manifest["files"].items():
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{folder}: {rel} is missing")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{folder}: {rel} has {size} bytes, the manifest says {meta['bytes']}")
        if file_digest(path) != meta["blake2b"]:
            raise CheckpointError(f"{folder}: {rel} is corrupted (checksum mismatch)")
    return manifest


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'field: checkpoint X, now Y' for every field of the fingerprints that differs."""
    a, b = _flat(saved), _flat(current)
    return [
        f"{k}: checkpoint {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
