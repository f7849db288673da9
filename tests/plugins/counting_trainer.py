"""A trainer backend from outside yatt, plugged in by import path (tests/test_plugins.py):

    trainer: {backend: tests.plugins.counting_trainer:CountingTrainer, counting: {log: calls.jsonl}}

It is the torch backend, counting its work: each `logprobs` and `train_mini_batch` call appends one JSON line
to the file its own config section names, so a test sees that the run trained through it. It declares the
rest of a backend's protocol too (yatt.backends): its section (`section`, `config`) and a `preflight` check.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from yatt.trainers.torch_trainer import TorchTrainer


class CountingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log: Path = Field(description="JSONL file that gets one line per logprobs / train_mini_batch call.")


class CountingTrainer(TorchTrainer):
    section = "counting"  # trainer.counting
    config = CountingConfig

    @staticmethod
    def preflight(trainer, world_size: int) -> None:
        folder = trainer.backend_config.log.parent
        if not folder.is_dir():
            raise ValueError(f"trainer.counting.log: folder not found: {folder}")

    def __init__(self, model_path, cfg, world, *args, **kwargs):
        super().__init__(model_path, cfg, world, *args, **kwargs)
        self.log, self.rank = cfg.backend_config.log, world.rank

    def _count(self, call: str, batch) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps({"call": call, "rank": self.rank, "head": self.head, "rows": len(batch)}) + "\n")

    def logprobs(self, batch, with_entropy=False):
        self._count("logprobs", batch)
        return super().logprobs(batch, with_entropy)

    def train_mini_batch(self, batch, loss_fn, with_entropy=False):
        self._count("train_mini_batch", batch)
        return super().train_mini_batch(batch, loss_fn, with_entropy)
