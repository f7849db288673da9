"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files in the run directory, and
Weights & Biases when installed and enabled (offline mode included). Written by rank 0 only.

Each sink has `log(step, metrics)` and `close()`; MetricsLogger calls them after writing metrics.jsonl.
A sink switched on explicitly whose package is missing is a start-up error naming the package and the
setting; `run.tensorboard: null` (the default) writes event files when tensorboard is installed.
"""

from __future__ import annotations

from pathlib import Path

from yatt.config import RunConfig


class WatchError(Exception):
    """A metrics sink that was asked for but cannot run (its package is missing)."""


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run: RunConfig, config: dict):
        import wandb

        w = run.wandb
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or run.name,
            mode=w.mode,
            dir=str(run.run_dir),
            config=config,
            resume="allow",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def open_sinks(run: RunConfig, config: dict) -> list:
    """The sinks the run config asks for (rank 0 calls this)."""
    sinks = []
    if run.tensorboard or (run.tensorboard is None and _installed("tensorboard")):
        if not _installed("tensorboard"):
            raise WatchError(
                "run.tensorboard=true needs the tensorboard package: pip install 'yatt[watch]' "
                "(or set run.tensorboard=false)"
            )
        sinks.append(TensorBoardSink(run.run_dir / "tensorboard"))
    if run.wandb.enabled:
        if not _installed("wandb"):
            raise WatchError("run.wandb.enabled=true needs the wandb package: pip install 'yatt[wandb]'")
        sinks.append(WandbSink(run, config))
    return sinks
