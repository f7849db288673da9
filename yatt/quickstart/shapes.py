"""Counting coloured squares, the visual quickstart task: a small PNG per row, generated offline.

Each image is a grid of cells (by default 2 x 2 cells of 16 x 16 pixels, 32 x 32 in all); each cell is empty
(black) or holds a red, green or blue square. The prompt asks for one colour; the answer is how many squares of
that colour the image shows (verified by exact match, like the addition task). With the defaults each cell is
exactly one image token of the tiny VL policy (2 x 2 patches of 8 pixels, merged by its pixel-shuffle
connector); the question's colour makes the model read the image and the text together. Measured: a 4 x 4 grid
of 8-pixel cells (4 cells per image token) did not lift the random-init policy above the majority answer
(26%) in 1100 SFT steps, so the default is the 2 x 2 grid.

    {"prompt": "<image>how many red?", "answer": "3", "data_source": "exact_match",
     "images": ["images/train_000012.png"]}

    python -m yatt.quickstart.shapes --out data/shapes [--seed 0]

writes images/ and sft.jsonl, train.jsonl, eval.jsonl (disjoint seeds; paths relative to the JSONL files).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 240)}
DEFAULT_SIZES = {"sft": 4000, "train": 4000, "eval": 200}


def draw_cells(cells: list[str | None], grid: int, cell: int):
    """The image of a grid (row-major list of colour names or None), each square inset by one pixel."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (grid * cell, grid * cell), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    for i, colour in enumerate(cells):
        if colour is not None:
            x, y = (i % grid) * cell, (i // grid) * cell
            draw.rectangle([x + 1, y + 1, x + cell - 2, y + cell - 2], fill=COLOURS[colour])
    return image


def shapes_row(rng: random.Random, grid: int, fill: float) -> tuple[list[str | None], dict]:
    cells = [rng.choice(list(COLOURS)) if rng.random() < fill else None for _ in range(grid * grid)]
    asked = rng.choice(list(COLOURS))
    return cells, {
        "prompt": f"<image>how many {asked}?",
        "answer": str(cells.count(asked)),
        "data_source": "exact_match",
    }


def write_shapes_split(
    out: Path, split: str, count: int, seed: int, grid: int = 2, cell: int = 16, fill: float = 0.75
) -> Path:
    """Write `count` rows of one split (images under out/images/) and return its JSONL path."""
    rng = random.Random(f"shapes:{split}:{seed}")
    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / f"{split}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            cells, row = shapes_row(rng, grid, fill)
            name = f"images/{split}_{i:06d}.png"
            draw_cells(cells, grid, cell).save(out / name, optimize=True)
            f.write(json.dumps({**row, "images": [name]}) + "\n")
    return path


def write_shapes_files(out: str | Path, seed: int = 0, sizes: dict[str, int] | None = None, **kw) -> list[Path]:
    out = Path(out)
    return [write_shapes_split(out, split, count, seed, **kw) for split, count in (sizes or DEFAULT_SIZES).items()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the counting-coloured-squares visual task.")
    parser.add_argument("--out", default="data/shapes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for p in write_shapes_files(args.out, args.seed):
        print(p)
