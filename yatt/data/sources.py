"""Open a configured data source (yatt.data.config) as this rank's shard: files, reasoning-gym, or the tasks of
a verifiers environment package (yatt.envs.verifiers_env)."""

from __future__ import annotations

from yatt.data.chat import as_chats
from yatt.data.config import DataSource, FileSource, GymSource, VerifiersSource
from yatt.data.gym import read_gym_shard
from yatt.data.records import Columns
from yatt.data.rows import PromptRow
from yatt.registry import Registry

# a file source's kind -> (files, rank, world_size, limit, columns) -> this rank's rows
FILE_READERS: Registry = Registry("data.<split>.kind", {
    "jsonl": "yatt.data.jsonl:read_jsonl_shard",
    "json": "yatt.data.files:read_json_shard",
    "parquet": "yatt.data.files:read_parquet_shard",
})


def columns(source: FileSource) -> Columns:
    """The column mapping a file reader applies to each record."""
    return Columns(source.prompt_key, source.messages_key, source.answer_key, source.data_source,
                   source.extra_columns, source.answer_regex, source.images_key)


def load_shard(source: DataSource, rank: int, world_size: int, limit: int | None = None) -> list[PromptRow]:
    """This rank's rows, as chats when the source sets chat: true (a verifiers task is a chat already)."""
    if isinstance(source, VerifiersSource):
        from yatt.envs.verifiers_env import read_task_shard

        return read_task_shard(source.taskset, source.options, source.start, source.size, rank, world_size, limit,
                               source.nltk_data)
    if isinstance(source, FileSource):
        rows = FILE_READERS.get(source.kind)(source.files, rank, world_size, limit, columns(source))
    elif isinstance(source, GymSource):
        rows = read_gym_shard(source.dataset, source.size, source.seed, source.options, rank, world_size, limit,
                              data_source=source.data_source)
    else:
        raise TypeError(f"unknown data source {source!r}")
    return as_chats(rows, source)


def describe(source: DataSource) -> str:
    """The source in a few words, for errors about the split as a whole (e.g. an empty file)."""
    if isinstance(source, FileSource):
        return ", ".join(str(f) for f in source.files)
    if isinstance(source, VerifiersSource):
        return f"{source.data_source} {source.options} (tasks {source.start}..{source.start + source.size - 1})"
    return f"reasoning_gym/{source.dataset} (size {source.size}, seed {source.seed})"
