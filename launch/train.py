"""Launch an RL run: one process per device, each a controller shard.

    torchrun --nproc_per_node 2 launch/train.py --config configs/quickstart.yaml --placement full \
        [--resume auto|PATH|none] [key.sub=value ...]
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from yatt.config import check_run, load_experiment  # noqa: E402
from yatt.config_loading import ConfigError  # noqa: E402
from yatt.data.errors import DataError  # noqa: E402
from yatt.distributed import close_world, env_rank, init_world  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description="yatt RL training (run under torchrun)")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. configs/quickstart.yaml")
    parser.add_argument("--placement", choices=["full", "partial"], help="shortcut for placement.mode")
    # auto by default: a requeued or restarted job reruns the same command line and must continue, not
    # start over and delete the checkpoints it would have continued from
    parser.add_argument("--resume", default="auto", metavar="auto|PATH|none",
                        help="auto (default): continue from the newest complete checkpoint of this run, or start "
                             "fresh if it has none; PATH: that checkpoint; none: start over, deleting this run's "
                             "checkpoints and metrics")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the YAML")
    args = parser.parse_intermixed_args()  # options may come after key=value overrides

    try:  # every rank validates, so a bad config or a missing file stops the job before any process group or
        # engine exists
        cfg = load_experiment(args.config, args.overrides, args.placement)
        check_run(cfg, int(os.environ.get("WORLD_SIZE", "1")), args.config)
    except ConfigError as err:
        if env_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2

    from yatt.checkpoint import CheckpointError  # heavy imports only once the config is good
    from yatt.controllers.run import run_experiment
    from yatt.transport.secret import RunSecretError

    world = init_world()
    try:
        run_experiment(cfg, world, args.resume)
    except (DataError, CheckpointError, RunSecretError) as err:
        if not getattr(err, "quiet", False):  # a quiet DataError: another rank printed the reason
            print(f"error (rank {world.rank}): {err}", file=sys.stderr)
        return 2
    finally:
        close_world()
    return 0


if __name__ == "__main__":
    sys.exit(main())
