"""kill -9 at random moments of checkpoint writes: resume always finds the newest complete checkpoint,
never a partial one, and never goes backwards."""

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from yatt.checkpoint.resume import find_resume, load_part
from yatt.checkpoint.writer import STEP_DIR

HERE = Path(__file__).resolve().parent


def test_sigkill_during_writes_never_exposes_a_partial_checkpoint(tmp_path):
    root, rng = tmp_path / "ckpt", random.Random(1234)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    best, partial_seen = 0, 0
    for rep in range(12):
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "checkpoint_crash_writer.py"), str(root), str(rng.choice([0.0, 0.005, 0.02]))],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        complete = sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
        partial_seen += any(".tmp-" in p.name for p in root.iterdir())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = find_resume(root, "auto")
        assert all("partial checkpoint" in str(w.message) for w in caught), [str(w.message) for w in caught]
        if not complete:
            assert found is None
            continue
        folder, manifest = found
        assert manifest["step"] == complete[-1] >= best, (rep, complete, best)
        best = manifest["step"]
        for stem, key in (("shared", "weights"), ("rank0", "x"), ("rank1", "x")):
            state = load_part(folder, stem)
            tensor = state[key]["w"] if key == "weights" else state[key]
            assert torch.all(tensor == best), (rep, stem)
    assert best >= 3, "the writer never got far enough to test anything"
    assert partial_seen >= 5, f"only {partial_seen} kills landed during a write"
