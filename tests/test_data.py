"""Data shards: disjoint, covering, read per rank; rows validated with file:line errors."""

import json

import pytest

from yatt.data.gym import read_gym_shard
from yatt.data.jsonl import DataError, read_jsonl_shard
from yatt.data.rows import PromptRow
from yatt.data.stream import PromptStream, merged
from yatt.rewards.rules import score


def write_rows(path, count, offset=0):
    path.write_text("".join(json.dumps({"prompt": f"q{offset + i}", "answer": str(i)}) + "\n" for i in range(count)))
    return path


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_jsonl_shards_are_disjoint_and_cover_the_data(tmp_path, world_size):
    files = [write_rows(tmp_path / "a.jsonl", 7), write_rows(tmp_path / "b.jsonl", 6, offset=7)]
    shards = [read_jsonl_shard(files, rank, world_size) for rank in range(world_size)]
    prompts = [row.prompt for shard in shards for row in shard]
    assert sorted(prompts) == sorted(f"q{i}" for i in range(13))  # covers, no duplicates
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # balanced


def test_gym_shards_are_disjoint_and_cover_the_data():
    shards = [read_gym_shard("basic_arithmetic", 20, 3, {}, rank, 2) for rank in range(2)]
    assert sorted(r.index for s in shards for r in s) == list(range(20))
    full = read_gym_shard("basic_arithmetic", 20, 3, {}, 0, 1)
    assert [r.prompt for r in shards[1]] == [full[i].prompt for i in range(1, 20, 2)]  # same items as unsharded
    row = full[0]
    assert score(row.answer, row) == 1.0 and score("nonsense", row) == 0.0


def test_rank_only_parses_its_own_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{broken\n{"prompt": "c", "answer": "3"}\n')
    assert [r.prompt for r in read_jsonl_shard([path], 0, 2)] == ["a", "c"]
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        read_jsonl_shard([path], 1, 2)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"answer": "1"}', "exactly one of 'prompt' or 'messages'"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}', "exactly one of"),
        ('{"prompt": "a", "answr": "1"}', "unknown field"),
        ('{"messages": [{"role": "user"}]}', "'messages' must be"),
        ('{"prompt": "a", "metadata": 3}', "'metadata' must be an object"),
    ],
)
def test_bad_rows_name_file_line_and_problem(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"{path}:3: .*{problem}"):
        read_jsonl_shard([path], 0, 1)


def test_chat_rows_and_eval_limit(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(
            {
                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                "answer": 4,
                "data_source": "last_number",
            }
        )
        + "\n"
        + '{"prompt": "x"}\n'
    )
    rows = read_jsonl_shard([path], 0, 1, limit=1)
    assert len(rows) == 1 and rows[0].question() == "hi" and rows[0].answer == "4"
    assert score("so it is 4", rows[0]) == 1.0


def test_stream_reshuffles_per_epoch_and_restores_its_cursor():
    rows = [PromptRow(i, f"p{i}", None, None, "exact_match") for i in range(5)]
    stream = PromptStream(rows, seed=1)
    first = [r.index for r in stream.next_batch(5)]
    assert sorted(first) == list(range(5))
    stream.next_batch(2)
    saved = stream.state_dict()
    expected = [r.index for r in stream.next_batch(6)]
    restored = PromptStream(rows, seed=1)
    restored.load_state_dict(saved)
    assert [r.index for r in restored.next_batch(6)] == expected
    with pytest.raises(ValueError, match="shard is empty"):
        PromptStream([], seed=0)


def _draws(streams: list[PromptStream], steps: int, per_step: int) -> list[set[int]]:
    """The prompts each step draws over all ranks (`per_step` in all, shared evenly)."""
    return [{r.index for s in streams for r in s.next_batch(per_step // len(streams))} for _ in range(steps)]


def test_the_streams_resume_on_another_number_of_ranks_at_the_same_position():
    """Rows cut into 2 streams: drawn by 2 ranks, then resumed by 1 (and back on 2), each step draws the prompts the
    run on 2 ranks would have; a number of ranks that does not divide the streams is refused."""
    rows = [PromptRow(i, f"p{i}", None, None, "exact_match") for i in range(11)]
    ranks = lambda world: [PromptStream([r for r in rows if r.index % world == k], 7, True, k, world, shards=2)  # noqa: E731
                           for k in range(world)]  # fmt: skip
    reference = _draws(ranks(2), 9, 4)
    two = ranks(2)
    assert _draws(two, 3, 4) == reference[:3]
    (one,) = ranks(1)
    one.load_state_dict(merged([s.state_dict() for s in two]))
    assert one.shards == 2 and _draws([one], 3, 4) == reference[3:6]
    back = ranks(2)
    for stream in back:
        stream.load_state_dict(merged([one.state_dict()]))
    assert _draws(back, 3, 4) == reference[6:]
    three = PromptStream(rows, 7, True, 0, 1, shards=3)
    with pytest.raises(ValueError, match="3 streams .*which 2 ranks cannot share out"):
        PromptStream([r for r in rows if r.index % 2 == 0], 7, True, 0, 2).load_state_dict(three.state_dict())
