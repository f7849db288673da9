"""A workload of image prompts at a realistic size, for benchmarks of what images cost a controller.

`write_workload` writes textured JPEGs (smooth colour fields, random shapes and noise: they compress like photos,
~62 KB at 448 pixels and quality 90, unlike a blank or pure-noise image) and a JSONL of yatt rows that reference
them; `write_policy` a VL folder from yatt.models.tiny_vl whose real Idefics3 processor keeps the images at their
full size (no splitting, no downscaling: image_size is the images' side), so the pixel tensors are what a real
policy's processor gives for them. Its weights are tiny and random: it is for the processor, not for running.
"""

from __future__ import annotations

import json
from pathlib import Path

PATCH, SHUFFLE = 14, 4  # SigLIP's patch; a pixel shuffle that gives 64 image tokens at 448 pixels


def textured_image(rng, size: int):
    """A photo-like test image: smooth colour fields, a few solid shapes, sensor-like noise (JPEG-compresses like
    a photo, ~60 KB at 448 pixels and quality 90, unlike a blank or pure-noise image)."""
    import numpy as np
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    pixels = np.full((size, size, 3), 128.0, dtype=np.float32)
    for c in range(3):
        for _ in range(4):
            fx, fy = rng.uniform(-6, 6, 2)
            pixels[..., c] += rng.uniform(10, 40) * np.sin(2 * np.pi * (fx * x + fy * y) + rng.uniform(0, 2 * np.pi))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(6, 16))):
        x0, y0 = (int(v) for v in rng.integers(0, size, 2))
        w, h = (int(v) for v in rng.integers(max(1, size // 16), max(2, size // 3), 2))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape([x0, y0, x0 + w, y0 + h], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    noisy = np.asarray(image).astype(np.float32) + rng.normal(0, 8, (size, size, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def write_workload(folder: Path, prompts: int, size: int, seed: int = 0) -> dict:
    """`prompts` JPEGs and a JSONL of rows that reference them (relative paths); returns their sizes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True)
    sizes = []
    with open(folder / "train.jsonl", "w") as f:
        for i in range(prompts):
            name = f"images/img_{i:05d}.jpg"
            textured_image(rng, size).save(folder / name, "JPEG", quality=90)
            sizes.append((folder / name).stat().st_size)
            f.write(json.dumps({"prompt": "<image>what is in the picture?", "answer": "a", "images": [name]}) + "\n")
    return {
        "images": prompts,
        "image_px": size,
        "mean_file_bytes": sum(sizes) / len(sizes),
        "total_file_bytes": sum(sizes),
    }


def write_policy(folder: Path, size: int) -> Path:
    from yatt.models.tiny_vl import TinyVLConfig, write_tiny_vl_model

    if size % (PATCH * SHUFFLE):
        raise SystemExit(f"--image-size must be a multiple of {PATCH * SHUFFLE} (patch {PATCH} x shuffle {SHUFFLE})")
    return write_tiny_vl_model(
        folder, TinyVLConfig(image_size=size, patch_size=PATCH, scale_factor=SHUFFLE, max_position_embeddings=512)
    )
