"""Asynchronous, crash-consistent checkpoints.

snapshot.py  state -> host-memory copies (+ a JSON tree), and back
writer.py    background writer, staging dir, per-rank done markers, manifest, atomic rename, keep-K
manifest.py  sizes + checksums; verify(); config fingerprint comparison
resume.py    which checkpoint to resume from (auto | PATH | none) and reading it
aside.py     what a launch replaces (old checkpoints, an old run's record) waits in replaced/ until it commits
checkpointer.py  what the run loop calls: resume (or refuse to start over), save at step boundaries,
                 SIGTERM/SIGUSR1
"""

from yatt.checkpoint.manifest import CheckpointError, verify

__all__ = ["CheckpointError", "verify"]
