"""Sharded reading of JSON (an array of records) and Parquet files, through the same column mapping as JSONL.

- Parquet is sharded by contiguous row ranges: rank r takes global rows [r*N/W, (r+1)*N/W) (N capped by
  `limit`), reading from each file's footer the row counts and then only the row groups that overlap its range,
  and only the mapped columns when extra columns are ignored. A file written with several row groups is never
  read whole by one rank; a single-row-group file is read by every rank that has rows in it.
- JSON (one array of objects, e.g. pandas `to_json(orient="records")`) cannot be split without parsing it, so
  every rank parses the file and keeps only its rows (row i goes to rank i % W, as for JSONL). Prefer JSONL or
  Parquet for large data.
Rows are named `file[i]`, i counting from 0 within the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from yatt.data.errors import DataError
from yatt.data.records import Columns, row_from_record
from yatt.data.rows import PromptRow


def read_json_shard(files: list[Path], rank: int, world_size: int, limit: int | None = None,
                    columns: Columns = Columns()) -> list[PromptRow]:
    rows: list[PromptRow] = []
    index = 0
    for path in files:
        try:
            records = json.loads(Path(path).read_bytes().decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not valid UTF-8 (byte offset {err.start})") from None
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
        if not isinstance(records, list):
            raise DataError(f"{path}: expected a JSON array of records, got {type(records).__name__} (for one "
                            "object per line use kind: jsonl)")
        for i, record in enumerate(records):
            if limit is not None and index >= limit:
                return rows
            if index % world_size == rank:
                rows.append(row_from_record(record, index, f"{path}[{i}]", columns, Path(path).parent))
            index += 1
    return rows


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("Parquet data needs pyarrow: pip install 'yatt[data]' (or pip install pyarrow)") from None
    return pq


def read_parquet_shard(files: list[Path], rank: int, world_size: int, limit: int | None = None,
                       columns: Columns = Columns()) -> list[PromptRow]:
    pq = _pyarrow_parquet()
    opened = []
    for path in files:
        try:
            opened.append((path, pq.ParquetFile(path)))  # reads the footer only
        except Exception as err:  # pyarrow raises ArrowInvalid & co. for a file that is not Parquet
            raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    total = sum(f.metadata.num_rows for _, f in opened)
    count = total if limit is None else min(total, limit)
    lo, hi = rank * count // world_size, (rank + 1) * count // world_size
    rows: list[PromptRow] = []
    start = 0  # global index of the current row group's first row
    for path, f in opened:
        names = f.schema_arrow.names
        wanted = [n for n in names if n in columns.known] if columns.extra_columns == "ignore" else names
        file_start = start
        for g in range(f.metadata.num_row_groups):
            end = start + f.metadata.row_group(g).num_rows
            first, last = max(start, lo), min(end, hi)
            if first < last:
                table = f.read_row_group(g, columns=wanted).slice(first - start, last - first)
                for offset, record in enumerate(table.to_pylist()):
                    index = first + offset
                    rows.append(row_from_record(record, index, f"{path}[{index - file_start}]", columns,
                                                 Path(path).parent))
            start = end
            if start >= hi:
                return rows
    return rows
