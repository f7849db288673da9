"""4-digit x 2-digit products, the tool quickstart's task: a tiny policy cannot multiply, the calculator can.

Rows are yatt JSONL prompt rows (``{"prompt": "1234*56=", "answer": "69104", "data_source": "last_number"}``);
the reward reads the last number of the last model turn (yatt.agents: `final_text`). `write_products_files`
writes:
- ``sft.jsonl``: the warm-up (`configs/sft_quickstart_tools.yaml`). A fraction `call_fraction` (0.25) of its rows
  call the calculator (named ``c``): their answer is the model's two turns, the call and the product copied from
  the tool's response, each ended by the end-of-sequence token; the warm-up replays them through the run's
  `tool_loop`, which runs the calculator and writes its response turn. The other rows guess: ``guess:69104``,
  which a model this size gets wrong. Every guess starts with the same token, so the warm-up learns to call with
  probability ~0.25 on any prompt and to guess with ~0.75: greedy decoding always guesses (held-out accuracy ~0),
  while the run's samples at temperature 1 call on ~25% of the prompts, right when the operands are copied. GRPO
  then raises how often it calls until greedy decoding calls too. Two things made the start depend on the machine
  before: with the guesses as bare digits, the call's first token competed with the product's first digit (the
  greedy policy called on 67% of the prompts on one machine, 96% on another); and with 40% of the rows calling,
  the first token's probability wandered around 0.5 from batch to batch (greedy called on 95% of the prompts
  after one warm-up, on none after the same warm-up 50 steps longer).
- ``train.jsonl`` (RL prompts) and ``eval.jsonl`` (held out); no (a, b) pair is in two files.

    python -m yatt.quickstart.products --out data/products [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from yatt.models.tiny import EOS
from yatt.quickstart.addition import write_jsonl

GUESS = "guess:"  # a direct answer's first tokens: one first token for every direct answer (see the docstring)
TOOL = "c"  # the calculator's name in configs/quickstart_tools.yaml (short: every character is a token)
DEFAULT_SIZES = {"sft": 20000, "train": 20000, "eval": 500}
# the tiny tokenizer's specials: the chat turns the tool loop writes (one id each)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]


def tool_call_text(a: int, b: int) -> str:
    """The model's turn that calls the calculator, compact JSON (what `yatt.tools.hermes` parses)."""
    call = json.dumps({"name": TOOL, "arguments": {"expression": f"{a}*{b}"}}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def product_row(a: int, b: int) -> dict:
    return {"prompt": f"{a}*{b}=", "answer": str(a * b), "data_source": "last_number"}


def sft_row(a: int, b: int, call: bool) -> dict:
    """A warm-up row: the model's turns (the call, ended by the end-of-sequence token, then the answer), or a
    direct answer."""
    row = product_row(a, b)
    row["answer"] = f"{tool_call_text(a, b)}{EOS}{a * b}" if call else f"{GUESS}{a * b}"
    return row


def product_pairs(count: int, rng: random.Random, taken: set) -> list[tuple[int, int]]:
    pairs = []
    while len(pairs) < count:
        pair = (rng.randint(1000, 9999), rng.randint(10, 99))
        if pair not in taken:
            taken.add(pair)
            pairs.append(pair)
    return pairs


def write_products_files(
    out: str | Path, seed: int = 0, call_fraction: float = 0.25, sizes: dict | None = None
) -> None:
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng, taken = random.Random(seed), set()
    pairs = {split: product_pairs(n, rng, taken) for split, n in sizes.items()}
    write_jsonl(out / "sft.jsonl", [sft_row(a, b, rng.random() < call_fraction) for a, b in pairs["sft"]])
    for split in ("train", "eval"):
        write_jsonl(out / f"{split}.jsonl", [product_row(a, b) for a, b in pairs[split]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="data/products")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--call-fraction", type=float, default=0.25)
    args = parser.parse_args()
    write_products_files(args.out, args.seed, args.call_fraction)


if __name__ == "__main__":
    main()
