"""Prompts from reasoning-gym's procedural generators (offline, verifiable)."""

from __future__ import annotations

from yatt.data.rows import PromptRow, shard_indices

GYM_PREFIX = "reasoning_gym/"


def chat_messages(question: str, system_prompt: str | None, instruction: str) -> list[dict]:
    """The question as an instruct model expects it: an optional system message, then the user's turn."""
    user = {"role": "user", "content": instruction.replace("{question}", question)}
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [user]


def read_gym_shard(dataset: str, size: int, seed: int, options: dict, rank: int, world_size: int,
                   limit: int | None = None, chat: bool = False, system_prompt: str | None = None,
                   instruction: str = "{question}", data_source: str | None = None) -> list[PromptRow]:
    """Generate only this rank's items: reasoning-gym builds item i from (seed, i) on demand.

    chat: the row holds messages (rendered by the tokenizer's chat template) instead of the raw question;
    data_source: the verifier (default: reasoning-gym's own scorer for the dataset)."""
    import reasoning_gym

    gym = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **options)
    count = size if limit is None else min(size, limit)
    rows = []
    for i in shard_indices(count, rank, world_size):
        item = gym[i]
        messages = chat_messages(item["question"], system_prompt, instruction) if chat else None
        rows.append(PromptRow(index=i, prompt=None if chat else item["question"], messages=messages,
                              answer=str(item["answer"]), data_source=data_source or GYM_PREFIX + dataset, metadata=item["metadata"],
                              origin=f"{GYM_PREFIX}{dataset} item {i} (seed {seed})"))
    return rows
