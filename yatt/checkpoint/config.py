"""The `checkpoint` section (yatt.checkpoint.checkpointer)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from yatt.config_loading import Section


class CheckpointConfig(Section):
    """Asynchronous, crash-consistent checkpoints (yatt.checkpoint); SIGTERM/SIGUSR1 always save."""

    every: int = Field(
        0, ge=0, description="Save every N steps, right after the weight sync (0: off; preemption signals still save)."
    )
    keep: int = Field(3, gt=0, description="Keep the newest K complete checkpoints; older ones are deleted.")
    async_write: bool = Field(
        True,
        description="Write in a background thread; training only waits for the "
        "host-memory snapshot. false: block until the files are on disk.",
    )
    export_hf: bool = Field(
        False, description="Also write the policy as a Hugging Face folder (policy/) inside each checkpoint."
    )
    dir: Path | None = Field(None, description="Where checkpoints go; default run_dir/checkpoints.")
    debug_write_delay_s: float = Field(
        0.0,
        ge=0.0,
        description="Test-only fault injection: sleep this long after each file written, to widen the crash window.",
        json_schema_extra={"hidden": True},  # kept out of docs/config.md
    )

    def root(self, run_dir: Path) -> Path:
        """Where this run's checkpoints go: `dir`, else run_dir/checkpoints."""
        return Path(self.dir or Path(run_dir) / "checkpoints")
