"""Vision-language policies: loading one from its folder, and turning a prompt's images into model inputs.

A prompt with images travels as *placeholder ids* (one image token per image, what the chat template gives)
plus the images' encoded bytes (PNG/JPEG as stored). Whoever runs the model expands it with the model's own
processor: vLLM does it internally; the hf engine and the trainer call `ImageInputs.encode`, which gives the
expanded ids (what the model sees and the trainer scores) and the pixel tensors (masks as bool). The expansion
is done per image with the processor (text = the image token alone) and spliced in at each placeholder, so it
works on token ids, whatever text the ids came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from yatt.data.errors import DataError
from yatt.data.images import IMAGE_PLACEHOLDER, decode_image

Pixels = dict[str, torch.Tensor]  # the processor's image tensors for one prompt, batch dimension 1


def is_vision_model(folder: str | Path) -> bool:
    """True when the folder's config.json describes a vision-language model (it has a vision_config)."""
    config = Path(folder) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def load_policy(folder: str | Path, **kwargs: Any):
    """The model of a folder: a causal LM, or an image-text-to-text model for a VL folder."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_model(folder) else AutoModelForCausalLM
    return auto.from_pretrained(str(folder), **kwargs)


def vision_parameter(name: str) -> bool:
    """Parameters of the vision tower (not the connector, not the decoder), by Hugging Face name."""
    return ".vision_model." in f".{name}" or ".vision_tower." in f".{name}" or ".visual." in f".{name}"


class ImageInputs:
    """A VL folder's processor, used on token ids: placeholder ids + image bytes -> expanded ids + pixels."""

    def __init__(self, folder: str | Path):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(folder))
        tokenizer = self.processor.tokenizer
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER))

    def encode(self, ids: list[int], images: list[bytes], where: str = "prompt") -> tuple[list[int], Pixels]:
        if ids.count(self.image_token_id) != len(images):
            raise DataError(f"{where}: {ids.count(self.image_token_id)} image placeholder(s) for {len(images)} images")
        out: list[int] = []
        parts: list[Pixels] = []
        it = iter(images)
        for token in ids:
            if token != self.image_token_id:
                out.append(int(token))
                continue
            image = decode_image(next(it), "image bytes", where)
            enc = self.processor(text=[IMAGE_PLACEHOLDER], images=[[image]], add_special_tokens=False,
                                 return_tensors="pt")
            out.extend(int(t) for t in enc["input_ids"][0])
            parts.append({k: _compact(k, v) for k, v in enc.items() if k not in ("input_ids", "attention_mask")})
        # one prompt's images side by side along the image axis (dim 1), as the processor batches them
        pixels = {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]} if parts else {}
        return out, pixels


def _compact(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A processor's pixel mask (e.g. Idefics3's pixel_attention_mask, int64: 8 bytes a pixel, more than the
    pixels' float32) as bool: the same mask, and the vision tower only tests it for non-zero."""
    return tensor.bool() if key.endswith("attention_mask") and not tensor.is_floating_point() else tensor
