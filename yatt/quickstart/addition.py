"""3-digit addition, the quickstart task, written in the yatt JSONL prompt format.

The yatt JSONL prompt format is one JSON object per line:

    {"prompt": "123+456=", "answer": "579", "data_source": "addition"}

- ``prompt``: the text given to the policy, verbatim (no chat template).
- ``answer``: the reference answer; a response is right when its text, up to the end-of-sequence
  token and stripped of surrounding whitespace, equals it exactly.
- ``data_source``: which task (and so which reward checker) the row belongs to.

``write_addition_files`` writes three disjoint files (no (a, b) pair is in two of them):
``sft.jsonl`` (supervised warm-up), ``train.jsonl`` (RL prompts) and ``eval.jsonl`` (held out).

    python -m yatt.quickstart.addition --out data/addition [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_SOURCE = "addition"
DEFAULT_SIZES = {"sft": 20000, "train": 10000, "eval": 500}


def addition_row(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": DATA_SOURCE}


def _sample_pairs(count: int, rng: random.Random, low: int, high: int, taken: set) -> list[tuple[int, int]]:
    """`count` distinct (a, b) pairs with low <= a, b <= high that are not in `taken` (which grows)."""
    if count > (high - low + 1) ** 2 - len(taken):
        raise ValueError(f"cannot draw {count} distinct pairs from [{low}, {high}]")
    pairs = []
    while len(pairs) < count:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in taken:
            taken.add(pair)
            pairs.append(pair)
    return pairs


def addition_rows(count: int, seed: int, low: int = 100, high: int = 999) -> list[dict]:
    """`count` rows with distinct (a, b) pairs, both operands in [low, high]; deterministic in `seed`."""
    rng = random.Random(seed)
    return [addition_row(a, b) for a, b in _sample_pairs(count, rng, low, high, set())]


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_addition_files(
    out: str | Path, seed: int = 0, sizes: dict[str, int] | None = None, low: int = 100, high: int = 999
) -> dict[str, Path]:
    """Write `<out>/{sft,train,eval}.jsonl` with pairwise disjoint (a, b) pairs; returns the paths."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    taken: set = set()
    # Draw the held-out set first so its contents do not depend on the other files' sizes.
    paths = {}
    for name in ("eval", "train", "sft"):
        rows = [addition_row(a, b) for a, b in _sample_pairs(sizes[name], rng, low, high, taken)]
        paths[name] = out / f"{name}.jsonl"
        write_jsonl(paths[name], rows)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the 3-digit addition JSONL files.")
    parser.add_argument("--out", default="data/addition", help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    for name, size in DEFAULT_SIZES.items():
        parser.add_argument(f"--{name}-rows", type=int, default=size, help=f"rows in {name}.jsonl")
    args = parser.parse_args(argv)
    sizes = {name: getattr(args, f"{name}_rows") for name in DEFAULT_SIZES}
    for name, path in write_addition_files(args.out, args.seed, sizes).items():
        print(f"wrote {sizes[name]} rows to {path}")


if __name__ == "__main__":
    main()
