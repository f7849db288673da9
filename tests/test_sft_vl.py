"""The VL warm-up tool: a few steps on the shapes task write a VL folder that transformers and yatt load."""

import torch

from yatt.models.vision import ImageInputs, is_vision_model, load_policy
from yatt.quickstart.sft_vl import encode_split, greedy_accuracy, run_sft_vl
from yatt.quickstart.shapes import write_shapes_files


def test_sft_vl_lowers_the_loss_and_writes_a_vl_folder(tmp_path):
    write_shapes_files(tmp_path / "data", sizes={"sft": 64, "eval": 16}, grid=2, cell=16)
    out = tmp_path / "policy"
    logs = []
    result = run_sft_vl(
        tmp_path / "data", out, stop_at=1.01, batch_size=16, max_steps=20, eval_every=10, log=logs.append
    )
    assert result["steps"] == 20 and len(result["history"]) == 2 and len(logs) == 2
    assert result["history"][-1]["loss"] < 2.0  # from ~log(87) for a random head: the answer format is learnt
    assert is_vision_model(out) and (out / "processor_config.json").is_file()
    inputs = ImageInputs(out)
    rows, prompts, pixels = encode_split(tmp_path / "data" / "eval.jsonl", inputs)
    acc = greedy_accuracy(load_policy(out, dtype=torch.float32), inputs.processor.tokenizer, rows, prompts, pixels)
    assert acc == result["accuracy"]  # the saved weights are the evaluated ones


def test_balanced_batches_draw_every_answer_equally_and_the_stop_needs_every_answer(tmp_path):
    import random
    from collections import Counter
    from types import SimpleNamespace

    from yatt.quickstart.sft_vl import balanced_sampler, per_answer_accuracy

    rows = [SimpleNamespace(answer=a) for a in "0" * 90 + "1" * 9 + "2"]
    counts = Counter(rows[i].answer for i in balanced_sampler(rows, random.Random(0))(3000))
    assert all(900 <= counts[a] <= 1100 for a in "012"), counts  # not 90% / 9% / 1%
    per = per_answer_accuracy(rows, [True] * 90 + [False] * 10)
    assert per == {"0": 1.0, "1": 0.0, "2": 0.0}  # 90% overall, yet two answers never right: no stop


def test_sft_vl_stops_only_when_every_answer_reaches_the_floor(tmp_path):
    write_shapes_files(tmp_path / "data", sizes={"sft": 64, "eval": 16}, grid=2, cell=16)
    result = run_sft_vl(
        tmp_path / "data",
        tmp_path / "policy",
        stop_at=0.0,
        min_answer_accuracy=1.01,
        batch_size=16,
        max_steps=10,
        eval_every=5,
        log=lambda _: None,
    )
    assert result["steps"] == 10  # accuracy >= 0 at once, but no answer can be > 100% right
    last = result["history"][-1]["per_answer"]
    assert last and all(0.0 <= v <= 1.0 for v in last.values())
    stopped = run_sft_vl(
        tmp_path / "data",
        tmp_path / "policy2",
        stop_at=0.0,
        min_answer_accuracy=0.0,
        batch_size=16,
        max_steps=10,
        eval_every=5,
        log=lambda _: None,
    )
    assert stopped["steps"] == 5
