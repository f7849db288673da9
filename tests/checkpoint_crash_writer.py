"""Helper of test_checkpoint_crash.py (not a test): a 2-rank checkpoint writer loop to be SIGKILLed.

It resumes like a run does (newest complete checkpoint, stale writes removed), then saves step after
step with both ranks' writers, every tensor filled with the step number so a reader can tell a torn
checkpoint from a whole one. A small per-file delay (fault injection) keeps it mid-write most of the time.
"""

import secrets
import sys
import warnings
from pathlib import Path

import torch

from yatt.checkpoint.resume import find_resume
from yatt.checkpoint.snapshot import snapshot
from yatt.checkpoint.writer import CheckpointWriter, SaveJob, remove_stale


def main(root: Path, delay_s: float) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = find_resume(root, "auto")
    start = found[1]["step"] if found else 0
    remove_stale(root)
    token = secrets.token_hex(4)
    writers = [CheckpointWriter(root, r, 2, token, keep=3, debug_write_delay_s=delay_s) for r in range(2)]
    print("ready", flush=True)
    for step in range(start + 1, start + 1000):
        for w in reversed(writers):
            w.wait()
            parts = {f"rank{w.rank}": snapshot({"progress": {"step": step}, "x": torch.full((1 << 18,), float(step))})}
            if w.rank == 0:
                parts["shared"] = snapshot({"weights": {"w": torch.full((1 << 20,), float(step))}})
            w.submit(SaveJob(step, parts, {"world_size": 2}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
