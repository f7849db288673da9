"""Sharded reading of JSONL prompt files.

Each line is one JSON object; by default in yatt's format:
  prompt       str   the prompt text, fed to the tokenizer as is            } exactly one of the two
  messages     list  chat messages [{"role": ..., "content": ...}, ...]     } (chat template applied)
  answer       str   reference answer used by the verifier (optional for judges that need none)
  data_source  str   names the rule verifier (yatt.rewards.rules); default "exact_match"
  metadata     dict  anything else the verifier needs (optional)
  images       list  image file paths (relative to this file) or data URIs (optional; yatt.data.images)
Other column names are mapped with `yatt.data.records.Columns`. Blank lines are skipped.

Sharding is by line striding: line i (counting non-blank lines across the files in order) belongs to rank
i % world_size. Every rank scans the bytes for line ends, but decodes and parses only its own lines, so no
rank holds the whole data set; a bad line is reported by the rank that owns it.
"""

from __future__ import annotations

import json
from pathlib import Path

from yatt.data.errors import DataError
from yatt.data.records import Columns, row_from_record
from yatt.data.rows import PromptRow


def parse_row(raw: bytes | str, index: int, where: str, columns: Columns = Columns(),
              base_dir: Path | None = None) -> PromptRow:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})") \
                from None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    return row_from_record(obj, index, where, columns, base_dir)


def read_jsonl_shard(files: list[Path], rank: int, world_size: int, limit: int | None = None,
                     columns: Columns = Columns()) -> list[PromptRow]:
    """The rows of `rank`'s shard, in file order; `limit` caps the global index (e.g. an eval subset)."""
    rows: list[PromptRow] = []
    index = 0
    for path in files:
        with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is reported with its file and line
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if limit is not None and index >= limit:
                    return rows
                if index % world_size == rank:
                    rows.append(parse_row(line, index, f"{path}:{line_no}", columns, Path(path).parent))
                index += 1
    return rows
