"""A step's images: read by the rank that owns the rows, when the step that uses them starts, and dropped after.

For each image row of the step's batch, `load_batch_images` reads the images' encoded bytes (the rank's own
rows only: the shard never holds another rank's rows) and runs the policy's processor once, giving what
both sides need: the engines get the placeholder ids and the bytes (vLLM and the hf engine expand them with
their own processor), the trainer gets the expanded ids and the pixel tensors. The result lives in the step's
rollouts (the G samples of a prompt share one object) and goes away with them.
"""

from __future__ import annotations

import torch

from yatt.data import images as image_files
from yatt.data.images import PromptImages
from yatt.data.rows import PromptRow
from yatt.models.vision import ImageInputs


def load_batch_images(
    rows: list[PromptRow], inputs: ImageInputs | None, prompt_ids: list[list[int]]
) -> list[PromptImages | None]:
    """Per row: its images loaded and encoded, or None for a text row."""
    out: list[PromptImages | None] = []
    for row, ids in zip(rows, prompt_ids, strict=True):
        if not row.images:
            out.append(None)
            continue
        if inputs is None:
            raise ValueError(f"{row.where}: the row has images but the policy is not a vision-language model")
        data = [image_files.read_image_bytes(ref, row.where) for ref in row.images]
        expanded, pixels = inputs.encode(ids, data, row.where)
        out.append(PromptImages(list(ids), data, expanded, pixels))
    return out


def reload_images(rollouts, inputs: ImageInputs | None, encode) -> None:
    """Rollouts taken back from a checkpoint keep their rows but not their pixels (Rollout.to_dict drops them):
    read and encode each image prompt's images again, once per prompt (its samples share the result), so a
    restored batch trains as the saved one did. `encode(rows)`: the rows' prompt ids, as a step encodes them."""
    shared: dict[tuple, PromptImages] = {}
    for r in rollouts:
        if r.vision is not None or r.row is None or not r.row.images:
            continue
        key = (r.row.index, tuple(r.prompt_ids))
        if key not in shared:
            shared[key] = load_batch_images([r.row], inputs, encode([r.row]))[0]
            if shared[key].prompt_ids != r.prompt_ids:
                raise ValueError(f"{r.row.where}: its images no longer expand to the checkpointed prompt")
        r.vision = shared[key]


def stack_pixels(rollouts) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The trainer's pixel inputs for a batch of rollouts (TokenBatch.pixels and .image_index): each distinct
    image prompt's pixels once, and per rollout the row of its prompt's (-1 for a text rollout); ({}, None)
    without image rollouts. The G samples of a prompt share one PromptImages (load_batch_images, reload_images,
    a balancing exchange), so they share one row. Image prompts must share one image layout (count and size
    of images); different layouts in one batch are refused here rather than mis-aligned."""
    rows: dict[int, int] = {}  # id(PromptImages) -> its pixel row
    images, index = [], []
    for r in rollouts:
        if r.vision is None:
            index.append(-1)
            continue
        if id(r.vision) not in rows:
            rows[id(r.vision)] = len(images)
            images.append(r.vision.pixels)
        index.append(rows[id(r.vision)])
    if not images:
        return {}, None
    layout = {k: tuple(v.shape[1:]) for k, v in images[0].items()}
    for pixels in images:
        if {k: tuple(v.shape[1:]) for k, v in pixels.items()} != layout:
            raise ValueError(
                f"image prompts of one batch have different image layouts ({layout} vs "
                f"{ {k: tuple(v.shape[1:]) for k, v in pixels.items()} }); not supported yet"
            )
    return {k: torch.cat([p[k] for p in images]) for k in layout}, torch.tensor(index, dtype=torch.long)
