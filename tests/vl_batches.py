"""Image-prompt batches for the trainer tests (tests/test_trainer_exactness_vl.py, tests/test_megatron_vl.py): a
tiny VL policy, the shapes task's images encoded by it, and GRPO-shaped batches of image groups and text rows."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from yatt.controllers.images import load_batch_images, stack_pixels
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.prepare import encode_prompts
from yatt.data.rollout import Rollout
from yatt.models.tiny_vl import TinyVLConfig, write_tiny_vl_model
from yatt.models.vision import ImageInputs
from yatt.quickstart.shapes import write_shapes_files
from yatt.tensors import TokenBatch


def vl_setup(root: Path) -> tuple[Path, list, list[list[int]]]:
    """A tiny VL policy folder, four image prompts encoded by it, and two text prompts' ids."""
    folder = write_tiny_vl_model(root / "policy", TinyVLConfig(hidden_size=64, intermediate_size=128), seed=1)
    write_shapes_files(root / "data", sizes={"train": 4})
    rows = read_jsonl_shard([root / "data" / "train.jsonl"], 0, 1)
    tok = AutoTokenizer.from_pretrained(folder)
    images = load_batch_images(rows, ImageInputs(folder), encode_prompts(rows, tok, 256))
    text = [tok(t, add_special_tokens=False).input_ids for t in ("how many red?", "2+2=")]
    return folder, images, text


def rollouts(images, text, sizes=(3, 1, 4, 2)) -> list[Rollout]:
    """GRPO-shaped rows: groups of an image prompt's samples with ragged responses (one empty), whose prompts
    all expand to the same ids (the shapes task asks one question of different images: they must not share),
    and text rows between them."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for g, (im, size) in enumerate(zip(images, sizes)):
        for i in range(size):
            n = 0 if (g, i) == (0, 1) else 1 + (g + i) % 4
            out.append(
                Rollout(
                    None,
                    im.prompt_ids,
                    torch.randint(3, 30, (n,), generator=gen).tolist(),
                    [0.0] * n,
                    "stop",
                    vision=im,
                )
            )
        if g < len(text):
            out.append(Rollout(None, text[g], [7, 8, 9], [0.0] * 3, "stop"))
    return out


def batch_of(rollouts_: list[Rollout], temperature: float = 1.0) -> TokenBatch:
    batch = TokenBatch.from_sequences([r.prompt_ids for r in rollouts_], [r.response_ids for r in rollouts_], 0)
    batch.pixels, batch.image_index = stack_pixels(rollouts_)
    batch.temperature = temperature
    return batch
