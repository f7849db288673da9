"""Local datasets: JSON and Parquet files with column mapping, sharded per rank (Parquet by row groups)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yatt.config import ExperimentConfig
from yatt.config_loading import ConfigError, load_config
from yatt.data.errors import DataError
from yatt.data.sources import load_shard
from yatt.rewards.rules import score

GSM8K_LIKE = [
    {"question": f"Tom has {i} apples and buys 2. How many?", "answer": str(i + 2), "level": i % 3} for i in range(10)
]


def source(kind, files, **mapping):
    cfg = ExperimentConfig(
        model={"path": "m"}, data={"train": {"kind": kind, "files": [str(f) for f in files], **mapping}}
    )
    return cfg.data.train


def write_parquet(path, records, row_group_size):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parquet_with_column_mapping_is_sharded_by_row_groups(tmp_path, monkeypatch, world_size):
    path = write_parquet(tmp_path / "gsm8k_train.parquet", GSM8K_LIKE, row_group_size=2)  # 5 row groups
    src = source("parquet", [path], prompt_key="question", data_source="last_number", extra_columns="ignore")
    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile,
        "read_row_group",
        lambda self, i, columns=None, **kw: (
            read.append((i, tuple(columns))) or original(self, i, columns=columns, **kw)
        ),
    )
    shards = []
    for rank in range(world_size):
        read.clear()
        shards.append(load_shard(src, rank, world_size))
        assert len(read) <= -(-5 // world_size) + 1  # its own row groups and at most one it shares
        assert world_size == 1 or len(read) < 5  # never the whole file
        assert all(sorted(cols) == ["answer", "question"] for _, cols in read)  # only the mapped columns
    rows = [r for s in shards for r in s]
    assert [r.index for r in rows] == list(range(10))  # contiguous blocks, disjoint, covering
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert rows[3].prompt == GSM8K_LIKE[3]["question"] and rows[3].answer == "5"
    assert rows[3].data_source == "last_number" and score("He has 5.", rows[3]) == 1.0
    assert rows[3].origin == f"{path}[3]"


def test_parquet_limit_and_two_files(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", GSM8K_LIKE[:6], 4)
    b = write_parquet(tmp_path / "b.parquet", GSM8K_LIKE[6:], 4)
    src = source("parquet", [a, b], prompt_key="question", extra_columns="metadata")
    both = [load_shard(src, r, 2, limit=8) for r in range(2)]
    assert [[r.index for r in s] for s in both] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert both[1][2].origin == f"{b}[0]" and both[1][2].metadata == {"level": 6 % 3}


def test_json_array_with_chat_column(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(
        json.dumps([{"conversation": [{"role": "user", "content": f"{i}+1?"}], "target": i + 1} for i in range(5)])
    )
    src = source("json", [path], messages_key="conversation", answer_key="target", data_source="last_number")
    shards = [load_shard(src, r, 2) for r in range(2)]
    assert [r.index for r in shards[1]] == [1, 3]
    assert shards[1][0].question() == "1+1?" and shards[1][0].answer == "2"


@pytest.mark.parametrize(
    "kind, content, problem",
    [
        ("json", '{"a": 1}', "expected a JSON array of records"),
        ("json", '[{"question": "q", "answer": "1", "other": 2}]', r"\[0\]: unknown field\(s\) \['other'\]"),
        ("json", '[{"answer": "1"}]', r"\[0\]: needs exactly one of 'question' or 'messages'"),
        ("parquet", "not parquet", "not a readable Parquet file"),
    ],
)
def test_bad_files_name_file_and_row(tmp_path, kind, content, problem):
    path = tmp_path / f"d.{kind}"
    path.write_text(content)
    with pytest.raises(DataError, match=problem):
        load_shard(source(kind, [path], prompt_key="question"), 0, 1)


def test_mapping_errors_at_config_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {path: m}\ndata:\n  train: {kind: parquet, files: [a.parquet], prompt_key: q, answer_key: q}\n"
    )
    with pytest.raises(ConfigError, match="must name different columns"):
        load_config(ExperimentConfig, path)


def test_answer_regex_takes_the_final_answer(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        json.dumps({"question": "q", "answer": "3 + 4 = <<3+4=7>>7 apples\n#### 7"})
        + "\n"
        + json.dumps({"question": "q2", "answer": "no marker"})
        + "\n"
    )
    src = source("jsonl", [path], prompt_key="question", answer_regex=r"####\s*(.+)$", data_source="last_number")
    assert load_shard(src, 0, 2)[0].answer == "7"
    with pytest.raises(DataError, match=rf"{path}:2: answer_regex .* does not match 'answer'"):
        load_shard(src, 1, 2)
    with pytest.raises(ValueError, match="needs a group"):
        source("jsonl", [path], answer_regex="####")
