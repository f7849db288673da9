"""One record of a user's file (a JSON object, a Parquet row) -> a validated PromptRow, through a column mapping.

yatt's own JSONL format is the default mapping: `prompt` or `messages`, `answer`, `data_source`, `metadata`,
`images` (yatt.data.images: paths relative to the data file, or data URIs).
A dataset saved in another shape (GSM8K's `question`/`answer`, MATH's `problem`/`solution`, a chat column)
is read by naming its columns instead of rewriting the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from yatt.data.errors import DataError
from yatt.data.images import IMAGE_PLACEHOLDER, parse_images, place_image_markers
from yatt.data.rows import PromptRow

DEFAULT_SOURCE = "exact_match"


@dataclass(frozen=True)
class Columns:
    """Which column holds what (yatt.data.config.FileSource documents each field)."""

    prompt_key: str = "prompt"
    messages_key: str | None = "messages"
    answer_key: str | None = "answer"
    data_source: str | None = None  # one verifier for every row; None: the row's own data_source column
    extra_columns: Literal["error", "ignore", "metadata"] = "error"
    answer_regex: str | None = None  # the reference is this regex's first group in the answer column
    images_key: str | None = "images"

    @property
    def known(self) -> set[str]:
        keys = {self.prompt_key, self.messages_key, self.answer_key, self.images_key, "data_source", "metadata"}
        return {k for k in keys if k is not None}

    @property
    def read(self) -> list[str]:
        """The columns a reader needs (all of them when extra columns go into metadata or are checked)."""
        return sorted(self.known)


def _present(record: dict, key: str | None) -> bool:
    return key is not None and record.get(key) is not None  # Parquet has every column in every row; null = absent


def row_from_record(record, index: int, where: str, columns: Columns = Columns(),
                    base_dir: Path | None = None) -> PromptRow:
    """Validate one record and build its row; every error names `where` (file:line or file row N).
    `base_dir`: the folder relative image paths are resolved against (the data file's)."""
    c = columns
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    extra = set(record) - c.known
    if extra and c.extra_columns == "error":
        raise DataError(f"{where}: unknown field(s) {sorted(extra)}; allowed: {sorted(c.known)} (map columns with "
                        "prompt_key/answer_key/messages_key, or set extra_columns: ignore | metadata)")
    has_prompt, has_messages = _present(record, c.prompt_key), _present(record, c.messages_key)
    if has_prompt == has_messages:
        names = f"'{c.prompt_key}'" + (f" or '{c.messages_key}'" if c.messages_key else "")
        raise DataError(f"{where}: needs exactly one of {names}" if c.messages_key else f"{where}: needs {names}")
    prompt = record.get(c.prompt_key) if has_prompt else None
    if has_prompt and not isinstance(prompt, str):
        raise DataError(f"{where}: '{c.prompt_key}' must be a string")
    messages = record.get(c.messages_key) if has_messages else None
    if has_messages and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise DataError(f"{where}: '{c.messages_key}' must be a non-empty list of {{role, content}} objects "
                        "with string values")
    answer = record.get(c.answer_key) if c.answer_key else None
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise DataError(f"{where}: '{c.answer_key}' must be a string or number")
    if answer is not None and c.answer_regex is not None:
        found = re.search(c.answer_regex, str(answer), flags=re.MULTILINE)
        if found is None:
            raise DataError(f"{where}: answer_regex {c.answer_regex!r} does not match '{c.answer_key}' "
                            f"({str(answer)[-60:]!r})")
        answer = found.group(1).strip()
    source = c.data_source or record.get("data_source") or DEFAULT_SOURCE
    if not isinstance(source, str):
        raise DataError(f"{where}: 'data_source' must be a string")
    metadata = record.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: 'metadata' must be an object")
    if extra and c.extra_columns == "metadata":
        metadata = {**{k: record[k] for k in sorted(extra)}, **metadata}
    images = parse_images(record.get(c.images_key) if c.images_key else None, base_dir, where)
    if images and prompt is not None:
        prompt = place_image_markers(prompt, len(images), where, c.prompt_key)
    elif images:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise DataError(f"{where}: a row with images needs a user message to put them in")
        markers = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        messages = [dict(m) for m in messages]  # the record's own list stays as it was
        if markers == 0:
            messages[users[-1]]["content"] = place_image_markers(messages[users[-1]]["content"], len(images), where,
                                                                 c.messages_key)
        elif markers != len(images):
            raise DataError(f"{where}: '{c.messages_key}' has {markers} {IMAGE_PLACEHOLDER} placeholder(s) for "
                            f"{len(images)} image(s)")
    return PromptRow(index=index, prompt=prompt, messages=messages, answer=None if answer is None else str(answer),
                     data_source=source, metadata=metadata, origin=where, images=images)
