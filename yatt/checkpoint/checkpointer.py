"""The run loop's view of checkpoints: resume, save at step boundaries, preemption signals.

Every method is called by every rank at the same point of the schedule (they may run collectives);
the background writer itself never does (see yatt.checkpoint.writer).
"""

from __future__ import annotations

import secrets
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from yatt.checkpoint.aside import drop_aside, set_aside
from yatt.checkpoint.config import CheckpointConfig
from yatt.checkpoint.manifest import CheckpointError, read_manifest
from yatt.checkpoint.resume import check_compatible, find_resume, load_part, load_resharded
from yatt.checkpoint.snapshot import Snapshot, snapshot
from yatt.checkpoint.writer import (
    CheckpointWriter,
    SaveJob,
    complete_checkpoints,
    point_latest,
    remove_stale,
    step_dir_name,
)
from yatt.distributed import World

# checkpoint.export_hf's hook: rank 0's replicated snapshot and the staging dir's policy/ path (None, None
# elsewhere) -> what the writer runs on that path, or None (yatt.checkpoint.export.policy_writer builds one)
ExportHook = Callable[[Snapshot | None, Path | None], Callable[[Path], None] | None]


class Stateful(Protocol):
    replicated: tuple[str, ...]  # keys of state_dict() identical on every rank: saved once, by rank 0

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PreemptionFlag:
    """SIGTERM/SIGUSR1 only set a flag; the run loop acts on it at the next step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self, world: World) -> int:
        """The signal any rank received (0: none); every rank gets the same answer, so all stop together."""
        return int(world.max([float(self.signum)])[0])

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class Checkpointer:
    """The run's checkpoints under `cfg.root(run_dir)`. `fingerprint`: what a checkpoint must agree on to be
    resumed (stored in each manifest, compared on resume). on_commit: called on rank 0 (by the writer thread:
    file-system work only) after each checkpoint commits, once what this launch set aside in the checkpoint root
    is deleted (yatt.checkpoint.aside)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        fingerprint: dict[str, Any],
        world: World,
        on_commit: Callable[[], None] | None = None,
    ):
        self.cfg, self.run_dir, self.world = cfg, Path(run_dir), world
        self.root = cfg.root(self.run_dir)
        self._on_commit = on_commit
        self.fingerprint = fingerprint
        token = world.broadcast_object(secrets.token_hex(4))  # one staging-dir token per launch, all ranks
        self.writer = CheckpointWriter(
            self.root,
            world.rank,
            world.size,
            token,
            cfg.keep,
            cfg.async_write,
            cfg.debug_write_delay_s,
            on_commit=self.committed,
        )
        self.saved_step = -1
        self.stall_seconds: list[float] = []

    # ---- resume --------------------------------------------------------------------------------
    def find(self, mode: str, overwrite: bool = False) -> tuple[Path, int] | None:
        """(checkpoint dir, step) chosen and verified by rank 0 for every rank, or None to start fresh. Reads only:
        `--resume none` over complete checkpoints is refused unless `overwrite` (CheckpointError, loud on rank 0)."""
        answer: Any = None
        if self.world.is_main:
            try:
                if (
                    mode == "none"
                    and not overwrite
                    and (done := complete_checkpoints(self.root) if self.root.is_dir() else [])
                ):
                    raise CheckpointError(
                        f"run {self.run_dir} has {len(done)} checkpoint(s) in {self.root} (newest "
                        f"{done[-1][1].name}); --resume none would start it over: add --overwrite (they are kept "
                        "until the new run's first checkpoint commits), or choose another run.name"
                    )
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    found = find_resume(self.root, mode)
                for w in caught:
                    print(f"warning: {w.message}", flush=True)
                if found is not None:
                    # checkpoints from before resharding fingerprinted the world size: they resume at that size only
                    sized = {"world_size": self.world.size} if "world_size" in found[1]["fingerprint"] else {}
                    check_compatible(found[0], found[1], {**self.fingerprint, **sized})
                    answer = (str(found[0]), int(found[1]["step"]))
            except CheckpointError as err:
                answer = f"error: {err}"
        answer = self.world.broadcast_object(answer)
        if isinstance(answer, str):
            raise CheckpointError(answer.removeprefix("error: "), quiet=not self.world.is_main)
        return None if answer is None else (Path(answer[0]), answer[1])

    def replace_newer(self, step: int) -> Path | None:
        """Rank 0, once every input is checked and before the first save: delete unfinished writes of earlier
        launches, and set aside (yatt.checkpoint.aside) the complete checkpoints after `step`, the resume point (0:
        starting over): an abandoned timeline, which `auto` must never pick later, kept until this launch commits.
        Where they went (None: nothing set aside). Other ranks do nothing: the caller barriers after it."""
        if not self.world.is_main:
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        if stale := remove_stale(self.root):
            print(f"checkpoint: removed unfinished writes of an earlier launch: {', '.join(stale)}", flush=True)
        aside = set_aside(self.root, [folder.name for s, folder in complete_checkpoints(self.root) if s > step])
        point_latest(self.root)
        return aside

    def committed(self) -> None:
        """This launch has a complete checkpoint (or, saving none, has finished): what it set aside goes."""
        drop_aside(self.root)
        if self._on_commit is not None:
            self._on_commit()

    def load(self, folder: Path, target: Stateful) -> None:
        """Restore `target` from a checkpoint saved by this number of ranks, or by another (resharding: each rank's
        part cut again by yatt.checkpoint.resume.load_resharded; the target refuses what it cannot take back)."""
        saved_world = read_manifest(folder)["world_size"]
        rank, world = self.world.rank, self.world.size
        if saved_world == world:
            state = load_part(folder, f"rank{rank}")
        else:
            state = load_resharded(folder, saved_world, rank, world)
        state.update(load_part(folder, "shared"))
        target.load_state_dict(state)
        self.saved_step = state["progress"]["step"]

    # ---- save ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        every = self.cfg.every
        return bool(every) and step % every == 0

    def save(self, step: int, source: Stateful, export: ExportHook | None = None) -> float:
        """Snapshot now, write in the background; returns the seconds training was blocked.

        `export` (with checkpoint.export_hf): called on every rank, in this thread, with rank 0's snapshot of
        the replicated state and the policy folder's path in the staging dir (None, None on other ranks), so it
        may gather a sharded model (a collective) and write it there; what it returns on rank 0 writes the rest
        of the policy folder (yatt.checkpoint.export.policy_writer). Its time counts in the stall."""
        start = time.perf_counter()
        self.writer.wait()  # the previous write, normally long finished: one write in flight at a time
        state = source.state_dict()
        shared = {k: state.pop(k) for k in source.replicated}
        parts = {f"rank{self.world.rank}": snapshot(state)}
        if self.world.is_main:
            parts["shared"] = snapshot(shared)
        export_fn = None
        if self.cfg.export_hf and export is not None:
            folder = self.writer.staging_dir(step) / "policy" if self.world.is_main else None
            export_fn = export(parts.get("shared"), folder)
            if not self.world.is_main:  # one policy folder per checkpoint, from rank 0
                export_fn = None
        self.writer.submit(SaveJob(step, parts, self.fingerprint, export_fn))
        self.saved_step = step
        stall = time.perf_counter() - start
        self.stall_seconds.append(stall)
        return stall

    def finish(self) -> Path:
        """Wait until the last save is on disk on every rank and committed; its directory."""
        self.writer.wait()
        self.world.barrier()  # rank 0's wait includes the commit, which needs every rank's files
        return self.root / step_dir_name(self.saved_step)
