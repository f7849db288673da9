"""Open a configured data source as this rank's shard."""

from __future__ import annotations

from yatt.config import DataSource, GymSource, JsonlSource
from yatt.data.gym import read_gym_shard
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.rows import PromptRow


def load_shard(source: DataSource, rank: int, world_size: int, limit: int | None = None) -> list[PromptRow]:
    if isinstance(source, JsonlSource):
        return read_jsonl_shard(source.files, rank, world_size, limit)
    if isinstance(source, GymSource):
        return read_gym_shard(source.dataset, source.size, source.seed, source.options, rank, world_size, limit)
    raise TypeError(f"unknown data source {source!r}")
