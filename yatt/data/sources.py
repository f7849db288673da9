"""Open a configured data source as this rank's shard."""

from __future__ import annotations

from yatt.config import DataSource, FileSource, GymSource
from yatt.data.gym import read_gym_shard
from yatt.data.rows import PromptRow
from yatt.registry import Registry

# a file source's kind -> (files, rank, world_size, limit, columns) -> this rank's rows
FILE_READERS: Registry = Registry("data.<split>.kind", {
    "jsonl": "yatt.data.jsonl:read_jsonl_shard",
    "json": "yatt.data.files:read_json_shard",
    "parquet": "yatt.data.files:read_parquet_shard",
})


def load_shard(source: DataSource, rank: int, world_size: int, limit: int | None = None) -> list[PromptRow]:
    if isinstance(source, FileSource):
        return FILE_READERS.get(source.kind)(source.files, rank, world_size, limit, source.columns)
    if isinstance(source, GymSource):
        return read_gym_shard(source.dataset, source.size, source.seed, source.options, rank, world_size, limit,
                              chat=source.chat, system_prompt=source.system_prompt, instruction=source.instruction,
                              data_source=source.data_source)
    raise TypeError(f"unknown data source {source!r}")


def describe(source: DataSource) -> str:
    """The source in a few words, for errors about the split as a whole (e.g. an empty file)."""
    if isinstance(source, FileSource):
        return ", ".join(str(f) for f in source.files)
    return f"reasoning_gym/{source.dataset} (size {source.size}, seed {source.seed})"
