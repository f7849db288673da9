"""Prompt ids through a real chat template: flat ints, the expected text, checked before engines start."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from chat_tokenizer import chat_tokenizer
from transformers import BatchEncoding

from yatt.config import ExperimentConfig
from yatt.config_loading import ConfigError, load_config
from yatt.data.config import GymSource
from yatt.data.errors import DataError
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.prepare import encode_prompts, load_rank_data
from yatt.data.sources import load_shard
from yatt.data.tokens import flat_ids
from yatt.distributed import World
from yatt.models.tiny import build_char_tokenizer

ONE = World(0, 1, 0, torch.device("cpu"))


def test_chat_prompt_ids_are_ints_and_render_the_template(tmp_path):
    tok = chat_tokenizer()
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}) + "\n")
    row = read_jsonl_shard([path], 0, 1)[0]
    ids = row.prompt_ids(tok)
    assert ids and all(type(t) is int for t in ids)
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]  # the special token, not its characters
    # what this transformers version returns for tokenize=True (a BatchEncoding in 5.x) gives the same ids
    raw = tok.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    assert flat_ids(raw, "x") == ids


@pytest.mark.parametrize(
    "encoded",
    [
        [1, 2, 3],
        [[1, 2, 3]],
        torch.tensor([1, 2, 3]),
        torch.tensor([[1, 2, 3]]),
        BatchEncoding({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}),
    ],
)
def test_flat_ids_accepts_the_shapes_tokenizers_return(encoded):
    assert flat_ids(encoded, "row") == [1, 2, 3]


@pytest.mark.parametrize("encoded", [["input_ids", "attention_mask"], [[1, 2], [3]], [1.0, 2.0], {"ids": [1]}])
def test_flat_ids_refuses_anything_else_naming_the_row(encoded):
    with pytest.raises(DataError, match="data.jsonl:7"):
        flat_ids(encoded, "data.jsonl:7")


def test_tiny_tokenizer_rejects_unknown_characters_naming_row_and_character(tmp_path):
    tok = build_char_tokenizer("0123456789+=")
    path = tmp_path / "new_task.jsonl"
    path.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "12/4=", "answer": "3"}\n')
    rows = read_jsonl_shard([path], 0, 1)
    assert rows[0].prompt_ids(tok) == tok("1+2=", add_special_tokens=False)["input_ids"]
    with pytest.raises(DataError, match=rf"{path}:2: character '/' \(position 2\) is not in the tokenizer's vocab"):
        rows[1].prompt_ids(tok)


def test_chat_row_needs_a_template(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "1+2="}]}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: a chat row .* no(ne)?"):
        read_jsonl_shard([path], 0, 1)[0].prompt_ids(build_char_tokenizer("0123456789+="))


def test_reasoning_gym_chat_rows_use_system_prompt_and_instruction():
    tok = chat_tokenizer()
    gym = {"kind": "reasoning_gym", "dataset": "basic_arithmetic", "size": 4, "seed": 1}
    rows = load_shard(
        GymSource(**gym, chat=True, system_prompt="Be brief.", instruction="{question}\nAnswer with a number."), 0, 1
    )
    plain = load_shard(GymSource(**gym), 0, 1)
    assert rows[0].prompt is None and rows[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert rows[0].messages[1]["content"] == plain[0].prompt + "\nAnswer with a number."
    text = tok.decode(rows[0].prompt_ids(tok))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


GSM8K_CHAT = {
    "kind": "parquet",
    "prompt_key": "question",
    "answer_key": "answer",
    "answer_regex": r"####\s*(.+)$",
    "data_source": "last_number",
    "chat": True,
    "system_prompt": "Think step by step.",
    "instruction": "{question}\nEnd with: the answer is N.",
}


def test_file_source_chat_renders_the_prompt_column_through_the_template(tmp_path):
    """chat: true on a Parquet file with a question column (GSM8K's shape): each question becomes the system prompt
    and the instruction's user message, through the tokenizer's chat template, in the ids the run checks and
    evaluates; the answer column is still read through answer_regex."""
    tok = chat_tokenizer()
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
                for i in range(4)
            ]
        ),
        path,
    )
    cfg = ExperimentConfig(
        model={"path": str(tmp_path)},
        data={"train": {**GSM8K_CHAT, "files": [str(path)]}, "eval": {**GSM8K_CHAT, "files": [str(path)]}},
    )
    data = load_rank_data(cfg.data, ONE, tok)
    row = data.train[1]
    assert (
        row.prompt is None
        and row.answer == "3"
        and row.question() == ("Tom has 1 apples and buys 2. How many?\nEnd with: the answer is N.")
    )
    assert tok.decode(data.eval_prompt_ids[1]) == (
        "<|im_start|>system\nThink step by step.<|im_end|>\n<|im_start|>user\nTom has 1 apples and buys 2. How "
        "many?\nEnd with: the answer is N.<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = load_shard(cfg.data.train.model_copy(update={"chat": False}), 0, 1)  # the default: raw text
    assert plain[1].messages is None and tok.decode(plain[1].prompt_ids(tok)) == plain[1].prompt


def test_file_source_chat_without_a_system_prompt(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2+3=", "answer": "5"}) + "\n")
    cfg = ExperimentConfig(
        model={"path": "m"},
        data={"train": {"kind": "jsonl", "files": [str(path)], "chat": True, "system_prompt": None}},
    )
    (row,) = load_shard(cfg.data.train, 0, 1)
    assert row.messages == [{"role": "user", "content": "2+3="}]


def test_file_source_chat_refuses_a_messages_row_naming_it(tmp_path):
    """With chat: true every row gets the source's system prompt and instruction; a row that is a chat already
    would silently escape them."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"prompt": "1+1=", "answer": "2"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "1+2="}], "answer": "3"})
        + "\n"
    )
    train = {"kind": "jsonl", "files": [str(path)]}
    assert len(load_shard(ExperimentConfig(model={"path": "m"}, data={"train": train}).data.train, 0, 1)) == 2
    chat = ExperimentConfig(model={"path": "m"}, data={"train": {**train, "chat": True}}).data.train
    with pytest.raises(DataError, match=rf"{path}:2: a 'messages' row in a source with chat: true"):
        load_shard(chat, 0, 1)


def test_instruction_needs_the_question_in_every_source(tmp_path):
    for train in ("{kind: jsonl, files: [a.jsonl]", "{kind: reasoning_gym, dataset: basic_arithmetic"):
        path = tmp_path / "c.yaml"
        path.write_text(f"model: {{path: m}}\ndata:\n  train: {train}, chat: true, instruction: 'Solve it.'}}\n")
        with pytest.raises(ConfigError, match=r"instruction must contain \{question\}"):
            load_config(ExperimentConfig, path)


def _cfg(tmp_path, train, eval_=None, **data):
    return ExperimentConfig(
        model={"path": str(tmp_path)},
        data={
            "train": {"kind": "jsonl", "files": [str(train)]},
            **({"eval": {"kind": "jsonl", "files": [str(eval_)]}} if eval_ else {}),
            **data,
        },
    )


def test_bad_rows_stop_before_engines_naming_the_row(tmp_path):
    tok = chat_tokenizer()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    data = load_rank_data(_cfg(tmp_path, good, good).data, ONE, tok)
    assert len(data.train) == 4 and all(type(t) is int for ids in data.eval_prompt_ids for t in ids)

    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "1+1="}\n' + json.dumps({"messages": [{"role": "user", "content": "x" * 40}]}) + "\n")
    with pytest.raises(DataError, match=rf"{long}:2: the prompt has \d+ tokens, more than data.max_prompt_tokens=32"):
        load_rank_data(_cfg(tmp_path, long, max_prompt_tokens=32).data, ONE, tok)

    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{bad_utf8}:2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        load_rank_data(_cfg(tmp_path, bad_utf8).data, ONE, tok)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=rf"data.train: no rows in {empty}"):
        load_rank_data(_cfg(tmp_path, empty).data, ONE, tok)
    with pytest.raises(DataError, match=rf"data.eval: no rows in {empty}"):
        load_rank_data(_cfg(tmp_path, good, empty).data, ONE, tok)


def test_encode_prompts_checks_length(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "123+456="}\n')
    rows = read_jsonl_shard([path], 0, 1)
    tok = build_char_tokenizer("0123456789+=")
    assert encode_prompts(rows, tok, 8) == [rows[0].prompt_ids(tok)]
    with pytest.raises(DataError, match=rf"{path}:1: the prompt has 8 tokens, more than data.max_prompt_tokens=7"):
        encode_prompts(rows, tok, 7)
