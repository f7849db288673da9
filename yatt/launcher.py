"""The launcher behind launch/train.py: check the config, run the ranks; a failure is one line, printed once.

    python launch/train.py --nproc 2 --config configs/quickstart.yaml --placement full \\
        [--resume auto|PATH|none] [--overwrite] [key.sub=value ...]
    torchrun --nproc_per_node 2 launch/train.py --config configs/quickstart.yaml ...   # the same run, via torchrun

Two ways in, the same ranks (each runs yatt.controllers.run.run_experiment):

- `--nproc N` (one machine). This process loads the config and checks it, and the files it names, for N ranks, so
  a bad config fails here, before any rank exists. It then runs torchrun's elastic agent in-process
  (torch.distributed.launcher.api: one node, a free rendezvous port, no restarts, OMP_NUM_THREADS=1 unless set, as
  torchrun does), each rank being launch/train.py without --nproc. A rank that fails writes its one line to its
  torchelastic error file rather than to stderr; the agent prints the line of the rank that failed first (a rank
  that failed only because another did reports nothing) and exits with that rank's code. Torch's own logging is
  off in this process, so no ChildFailedError report follows.
- plain `torchrun` (also across nodes). Each rank checks the config; rank 0 reports a bad one, and the others
  wait for it (up to CONFIG_REPORT_WAIT_S), since torchrun stops every rank once one exits. A failing rank prints
  its one line itself, only if it found the problem, writes it to its error file (torchrun shows it as the root
  cause) and exits with its code. torchrun then adds its own report, which only `--nproc` avoids. Across
  nodes, a rank whose peer node is lost (killed, cut off) prints one line naming that node, within
  `run.peer_timeout_s` and a heartbeat, whatever it was waiting on (yatt.peers).

Exit codes: 0 done (or preempted after a checkpoint); 2 bad input (config, files, data rows and images, the
checkpoint to resume, the run directory, the run secret); 1 anything else. Under --nproc that is one line too, and
the traceback goes to run_dir/logs/rank<r>.traceback; under plain torchrun it is the usual traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import NoReturn

from yatt.config import ExperimentConfig, load_experiment
from yatt.config_loading import ConfigError
from yatt.data.errors import DataError
from yatt.preflight import check_run
from yatt.quick_exit import quick_exit

AGENT_ENV = "YATT_LAUNCH_AGENT"  # set by the --nproc agent for its ranks: they report through the error file only
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set per rank by torch's elastic agent (torchrun's and ours)
CONFIG_REPORT_WAIT_S = 60.0  # how long a rank other than 0 leaves a bad config to rank 0 to report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="yatt RL training: --nproc N starts N ranks, or run it under torchrun")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. configs/quickstart.yaml")
    parser.add_argument("--placement", choices=["full", "partial"], help="shortcut for placement.mode")
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="start N ranks on this machine (torchrun's agent, in-process); omit under torchrun",
    )
    # auto by default: a requeued or restarted job reruns the same command line and must continue, not
    # start over and replace the checkpoints it would have continued from
    parser.add_argument(
        "--resume",
        default="auto",
        metavar="auto|PATH|none",
        help="auto (default): continue from the newest complete checkpoint of this run, or start "
        "fresh if it has none; PATH: that checkpoint; none: start over (needs --overwrite if "
        "the run has checkpoints)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="let --resume none start over a run that has checkpoints; what it replaces is kept "
        "in replaced/ until the new run's first checkpoint commits",
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the YAML")
    args = parser.parse_intermixed_args(argv)  # options may come after key=value overrides
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    return args


def one_line(message: str) -> str:
    """A possibly multi-line message (e.g. a config's list of invalid fields) as one line."""
    first, *rest = [part.strip() for part in str(message).splitlines() if part.strip()] or [""]
    return first + (": " + "; ".join(rest) if rest else "")


def checked_config(args: argparse.Namespace, world_size: int) -> ExperimentConfig:
    """The experiment config, validated and checked against the ranks launched and the files it names."""
    cfg = load_experiment(args.config, args.overrides, args.placement)
    check_run(cfg, world_size, args.config)
    return cfg


def entry(argv: list[str], script: str) -> NoReturn:
    """launch/train.py: `main`'s exit code, without Python's slow teardown of torch (yatt.quick_exit)."""
    quick_exit(main(argv, script))


def main(argv: list[str], script: str) -> int:
    """launch/train.py's entry point; `script`: its path, which each rank of --nproc runs."""
    args = parse_args(argv)
    return run_agent(args, script) if args.nproc is not None else run_rank(args)


# ---- a rank ---------------------------------------------------------------------------------------------------
def report(line: str, quiet: bool, code: int) -> int:
    """A rank's failure: `line` once (a quiet rank only learned of it from another), on stderr unless the --nproc
    agent prints it, and in torchelastic's error file for the agent (its time in ns picks the first failure)."""
    if quiet:
        return code
    if not os.environ.get(AGENT_ENV):
        print(line, file=sys.stderr, flush=True)
    if path := os.environ.get(ERROR_FILE_ENV):
        data = {
            "message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}},
            "yatt": {"line": line, "code": code, "time_ns": time.time_ns()},
        }
        Path(path).write_text(json.dumps(data))
    return code


def run_rank(args: argparse.Namespace) -> int:
    """One rank (under torchrun, the --nproc agent, or alone as a world of one)."""
    rank = int(os.environ.get("RANK", "0"))
    try:  # every rank validates, so a bad config or a missing file stops the job before any process group exists
        cfg = checked_config(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as err:
        if rank != 0:  # rank 0 reports it; exiting first would let torchrun stop rank 0 before it prints
            time.sleep(CONFIG_REPORT_WAIT_S)  # torchrun ends this rank once rank 0 exits; else rank 0's config held
        return report(f"error: {one_line(err)}", quiet=False, code=2)

    from yatt.checkpoint import CheckpointError  # heavy imports only once the config is good
    from yatt.controllers.run import run_experiment
    from yatt.distributed import close_world, init_world
    from yatt.peers import watch_peers
    from yatt.transport.secret import RunSecretError

    # reported before the process group closes: the agent stops every rank as soon as one exits
    watch = None
    try:
        world = init_world()
        # across nodes: a lost node is one line naming it, within run.peer_timeout_s (yatt.peers)
        watch = watch_peers(
            world, cfg.run.peer_timeout_s, lambda line: report(f"error (rank {rank}): {line}", False, 1)
        )
        run_experiment(cfg, world, args.resume, args.overwrite)
    except (DataError, CheckpointError, RunSecretError) as err:
        # quiet: another rank found the problem and reports it
        return report(f"error (rank {rank}): {one_line(err)}", quiet=getattr(err, "quiet", False), code=2)
    except Exception as err:  # a bug, or a peer that died: under the agent one line, the traceback in a file
        if watch is not None:  # a peer node that died: the watch reports it and ends this process
            watch.wait_verdict(since=time.monotonic())
        if not os.environ.get(AGENT_ENV):
            raise
        where = save_traceback(cfg.run.run_dir / "logs" / f"rank{rank}.traceback")
        return report(f"error (rank {rank}): {type(err).__name__}: {one_line(err)} ({where})", quiet=False, code=1)
    finally:
        if watch is not None:
            watch.stop()
        close_world()
    return 0


def save_traceback(path: Path) -> str:
    """The current exception's traceback written to `path`; where it went, for the one line."""
    text = traceback.format_exc()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return f"traceback: {path}"
    except OSError:
        print(text, file=sys.stderr, flush=True)
        return "traceback above"


# ---- the --nproc agent ----------------------------------------------------------------------------------------
def rank_argv(args: argparse.Namespace) -> list[str]:
    """The command line of each rank: this one without --nproc."""
    return [
        "--config",
        args.config,
        *(["--placement", args.placement] if args.placement else []),
        "--resume",
        args.resume,
        *(["--overwrite"] if args.overwrite else []),
        *args.overrides,
    ]


def first_failure(failures: dict) -> tuple[str, int]:
    """The line and exit code of the rank that failed first (by its error file, see `report`); a rank that died
    without one (a signal, a crash in C) when no rank reported."""
    reported = [
        f.error_file_data["yatt"]
        for f in failures.values()
        if isinstance(f.error_file_data, dict) and "yatt" in f.error_file_data
    ]
    if reported:
        first = min(reported, key=lambda r: r["time_ns"])
        return first["line"], int(first["code"])
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return f"error (rank {rank}): the process ended with {how} and no report (its output is above)", 1


def run_agent(args: argparse.Namespace, script: str) -> int:
    """Check the config for --nproc ranks, then run them under torch's elastic agent in this process."""
    try:
        checked_config(args, args.nproc)
    except ConfigError as err:
        print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
        return 2

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.disable(logging.CRITICAL)  # the agent's progress and failure reports: this process prints its own
    os.environ[AGENT_ENV] = "1"
    if args.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="yatt-launch-") as logs:  # the ranks' error files
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=args.nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        try:
            elastic_launch(config, sys.executable)(script, *rank_argv(args))
        except ChildFailedError as err:
            line, code = first_failure(err.failures)
            print(line, file=sys.stderr, flush=True)
            return code
        except SignalException as err:  # SIGTERM/SIGINT: the agent passed it on to the ranks (in the step loop a
            # rank saves a checkpoint and stops, see yatt.checkpoint.checkpointer.PreemptionFlag)
            return 128 + int(err.sigval)
    return 0
