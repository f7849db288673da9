"""The VL warm-up tool: a few steps on the shapes task write a VL folder that transformers and yatt load."""

import torch

from yatt.models.vision import ImageInputs, is_vision_model, load_policy
from yatt.quickstart.sft_vl import encode_split, greedy_accuracy, run_sft_vl
from yatt.quickstart.shapes import write_shapes_files


def test_sft_vl_lowers_the_loss_and_writes_a_vl_folder(tmp_path):
    write_shapes_files(tmp_path / "data", sizes={"sft": 64, "eval": 16}, grid=2, cell=16)
    out = tmp_path / "policy"
    logs = []
    result = run_sft_vl(tmp_path / "data", out, stop_at=1.01, batch_size=16, max_steps=20, eval_every=10,
                        log=logs.append)
    assert result["steps"] == 20 and len(result["history"]) == 2 and len(logs) == 2
    assert result["history"][-1]["loss"] < 2.0  # from ~log(87) for a random head: the answer format is learnt
    assert is_vision_model(out) and (out / "processor_config.json").is_file()
    inputs = ImageInputs(out)
    rows, prompts, pixels = encode_split(tmp_path / "data" / "eval.jsonl", inputs)
    acc = greedy_accuracy(load_policy(out, dtype=torch.float32), inputs.processor.tokenizer, rows, prompts, pixels)
    assert acc == result["accuracy"]  # the saved weights are the evaluated ones
