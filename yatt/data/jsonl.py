"""Sharded reading of JSONL prompt files.

Each line is one JSON object with these fields:
  prompt       str   the prompt text, fed to the tokenizer as is            } exactly one of the two
  messages     list  chat messages [{"role": ..., "content": ...}, ...]     } (chat template applied)
  answer       str   reference answer used by the verifier (optional for judges that need none)
  data_source  str   names the rule verifier (yatt.rewards.rules); default "exact_match"
  metadata     dict  anything else the verifier needs (optional)
Blank lines are skipped. A rank parses only the lines of its own shard (line i goes to rank
i % world_size, counting across the files in order), so no rank holds the whole data set.
"""

from __future__ import annotations

import json
from pathlib import Path

from yatt.data.rows import PromptRow

ALLOWED_FIELDS = {"prompt", "messages", "answer", "data_source", "metadata"}


class DataError(Exception):
    """A data row that cannot be used; the message names file and line."""


def parse_row(text: str, index: int, where: str) -> PromptRow:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - ALLOWED_FIELDS
    if unknown:
        raise DataError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(ALLOWED_FIELDS)}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise DataError(f"{where}: needs exactly one of 'prompt' or 'messages'")
    if has_prompt and not isinstance(obj["prompt"], str):
        raise DataError(f"{where}: 'prompt' must be a string")
    if has_messages and not (isinstance(obj["messages"], list) and obj["messages"]
                             and all(isinstance(m, dict) and "role" in m and "content" in m for m in obj["messages"])):
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: 'answer' must be a string or number")
    source = obj.get("data_source", "exact_match")
    if not isinstance(source, str):
        raise DataError(f"{where}: 'data_source' must be a string")
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: 'metadata' must be an object")
    return PromptRow(index=index, prompt=obj.get("prompt"), messages=obj.get("messages"),
                     answer=None if answer is None else str(answer), data_source=source, metadata=metadata)


def read_jsonl_shard(files: list[Path], rank: int, world_size: int, limit: int | None = None) -> list[PromptRow]:
    """The rows of `rank`'s shard, in file order; `limit` caps the global index (e.g. an eval subset)."""
    rows: list[PromptRow] = []
    index = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if limit is not None and index >= limit:
                    return rows
                if index % world_size == rank:
                    rows.append(parse_row(line, index, f"{path}:{line_no}"))
                index += 1
    return rows
