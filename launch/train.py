"""Launch an RL run: one process per device, each a controller shard.

    python launch/train.py --nproc 2 --config configs/quickstart.yaml --placement full \\
        [--resume auto|PATH|none] [--overwrite] [key.sub=value ...]
    torchrun --nproc_per_node 2 launch/train.py --config configs/quickstart.yaml ...   # the same, across nodes too

--nproc N checks the config, then starts N ranks on this machine (torchrun's agent, in-process); a failure is one
line from the rank that found it. --resume none on a run with checkpoints needs --overwrite; what it replaces is
kept until the new run's first checkpoint commits. Exit code 2: bad input. See yatt/launcher.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from yatt.launcher import entry  # noqa: E402

if __name__ == "__main__":
    entry(sys.argv[1:], script=str(Path(__file__).resolve()))
