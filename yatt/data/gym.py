"""Prompts from reasoning-gym's procedural generators (offline, verifiable)."""

from __future__ import annotations

from yatt.data.rows import PromptRow, shard_indices

GYM_PREFIX = "reasoning_gym/"


def read_gym_shard(dataset: str, size: int, seed: int, options: dict, rank: int, world_size: int,
                   limit: int | None = None, data_source: str | None = None) -> list[PromptRow]:
    """Generate only this rank's items: reasoning-gym builds item i from (seed, i) on demand.

    Each row holds the raw question (yatt.data.sources makes it a chat when the source says so);
    data_source: the verifier (default: reasoning-gym's own scorer for the dataset)."""
    import reasoning_gym

    gym = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **options)
    count = size if limit is None else min(size, limit)
    rows = []
    for i in shard_indices(count, rank, world_size):
        item = gym[i]
        rows.append(PromptRow(index=i, prompt=item["question"], messages=None, answer=str(item["answer"]),
                              data_source=data_source or GYM_PREFIX + dataset, metadata=item["metadata"],
                              origin=f"{GYM_PREFIX}{dataset} item {i} (seed {seed})"))
    return rows
