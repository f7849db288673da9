"""SFT of any HF causal LM: messages rows with the loss on assistant tokens only, init_from a model folder,
the stop check through the verifier registry (by data_source), row errors from the launcher."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_tokenizer import chat_tokenizer

from yatt.data.errors import DataError
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.sft import encode_examples, eval_prompt
from yatt.models.tiny import TinyModelConfig, build_tiny_model
from yatt.quickstart import sft as sft_module
from yatt.quickstart.sft import SFTConfig, evaluate, run_sft

REPO = Path(__file__).resolve().parents[1]


def chat_rows(path, count, data_source="last_number"):
    rows = [
        {
            "messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}],
            "data_source": data_source,
        }
        for a in range(10)
        for b in range(10)
    ][:count]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """An HF folder of a tiny Qwen2 with the ChatML tokenizer, standing in for any instruct model."""
    folder = tmp_path_factory.mktemp("chat_model")
    tok = chat_tokenizer()
    tok.eos_token = "<|im_end|>"  # as in SmolLM2: the end of a turn ends generation
    model = build_tiny_model(
        TinyModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
        ),
        len(tok),
        tok.eos_token_id,
        tok.pad_token_id,
        seed=0,
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_loss_only_on_assistant_turns(tmp_path):
    tok = chat_tokenizer()
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "1+2?"},
                    {"role": "assistant", "content": "3"},
                    {"role": "user", "content": "and 2+2?"},
                    {"role": "assistant", "content": "4"},
                ]
            }
        )
        + "\n"
    )
    ids, labels = encode_examples(read_jsonl_shard([path], 0, 1), tok)
    assert tok.decode(ids[0]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n<|im_start|>user\nand 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    learned = tok.decode([int(t) for t, y in zip(ids[0], labels[0]) if y != -100])
    assert learned == "3<|im_end|>\n4<|im_end|>\n"  # the assistant turns and their end-of-turn text, nothing else
    assert bool((labels[0][labels[0] != -100] == ids[0][labels[0] != -100]).all())


def test_eval_prompt_stops_before_the_last_assistant_turn(tmp_path):
    tok = chat_tokenizer()
    row = read_jsonl_shard([chat_rows(tmp_path / "c.jsonl", 3)], 0, 1)[2]
    ids, scored = eval_prompt(row, tok)
    assert tok.decode(ids).endswith("user\n0+2?<|im_end|>\n<|im_start|>assistant\n") and scored.answer == "2"


def test_stop_check_goes_through_the_rows_verifier(tmp_path, monkeypatch, chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(chat_model), AutoModelForCausalLM.from_pretrained(chat_model)
    # every response is "it is 3": right for the last_number verifier, wrong for exact_match
    reply = tok("it is 3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    monkeypatch.setattr(sft_module, "greedy_decode", lambda m, p, n, e, s=None: torch.tensor([reply] * p.shape[0]))
    for source, expected in (("last_number", 1.0), ("exact_match", 0.0)):
        path = tmp_path / f"{source}.jsonl"
        path.write_text(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}],
                    "data_source": source,
                }
            )
            + "\n"
        )
        assert evaluate(model, tok, read_jsonl_shard([path], 0, 1), 8) == {"accuracy": expected}


def test_sft_from_an_hf_folder_on_messages_rows(tmp_path, chat_model):
    torch.set_num_threads(1)
    cfg = SFTConfig(
        init_from=chat_model,
        sft_file=chat_rows(tmp_path / "sft.jsonl", 100),
        eval_file=chat_rows(tmp_path / "eval.jsonl", 8),
        output_dir=tmp_path / "out",
        lr=3e-3,
        warmup_steps=0,
        batch_size=16,
        max_steps=20,
        eval_every=10,
        max_new_tokens=4,
        log_every=5,
    )
    lines = []
    summary = run_sft(cfg, log=lines.append)
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]
    assert any(line.startswith("step     5") and "tok/s" in line for line in lines)  # progress between evals
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_launcher_names_the_row_and_character(tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "12/4=", "answer": "3"}\n')
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"model: {{alphabet: '0123456789+='}}\nsft_file: {sft}\neval_file: {sft}\noutput_dir: {tmp_path / 'out'}\n"
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch/sft.py"), "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip() == f"error: {sft}:2: character '/' (position 2) is not in the tokenizer's vocabulary; "
        "it would become '<pad>'"
    )


def test_sft_rows_need_something_to_learn(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+2="}\n' + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rows = read_jsonl_shard([path], 0, 1)
    with pytest.raises(DataError, match=rf"{path}:1: .* needs an 'answer'"):
        encode_examples(rows[:1], chat_tokenizer())
    with pytest.raises(DataError, match=rf"{path}:2: .* at least one assistant message"):
        encode_examples(rows[1:], chat_tokenizer())
