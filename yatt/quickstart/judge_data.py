"""Training and held-out rows for the quickstart judge: "is this response to a+b= the reference answer?"

Each row is an SFT row (prompt = the judge template filled in, answer = "yes" or "no") whose label is
the rule verifier's own verdict, so a judge that learns the rows agrees with the rule. Half of the
responses are wrong in the ways a partly trained policy is wrong: one digit off, a lost or extra
carry, a missing or extra digit, swapped digits, stray characters, or nothing at all.

    python -m yatt.quickstart.judge_data --out data/addition   # judge_{sft,eval}_{basic,near_miss}.jsonl
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from yatt.genrm.template import render
from yatt.quickstart.addition import read_jsonl, write_jsonl
from yatt.rewards.rules import answers_match

QUICKSTART_TEMPLATE = "{question}{reference}:{response}?"
STRAY = "0123456789+=-"


# Two stages (a curriculum): "basic" teaches the judge to compare digits at all (wrong lengths alone would
# teach it to count characters and stall near 85%); "near_miss" then adds a digit copied from its
# neighbour ("1421" -> "1411"), the mistake a basic judge waves through most often on policy samples
# (7% of wrong answers judged right). Trained from scratch on near_miss, the judge learns more slowly.
MIXES = {
    "basic": (["digit", "carry", "drop", "extra", "swap", "random", "stray", "empty"], [40, 25, 5, 5, 10, 5, 5, 5]),
    "near_miss": (
        ["digit", "neighbour", "carry", "drop", "extra", "swap", "random", "stray", "empty"],
        [25, 25, 20, 5, 5, 5, 5, 5, 5],
    ),
}


def wrong_response(answer: str, rng: random.Random, mix: str = "near_miss") -> str:
    """A response that the exact-match rule rejects, drawn from typical arithmetic mistakes."""
    kinds, weights = MIXES[mix]
    kind = rng.choices(kinds, weights=weights)[0]
    digits = list(answer)
    if kind == "digit":
        i = rng.randrange(len(digits))
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        text = "".join(digits)
    elif kind == "neighbour" and len(set(digits)) > 1:
        i = rng.choice(
            [
                k
                for k in range(len(digits))
                if any(0 <= k + d < len(digits) and digits[k + d] != digits[k] for d in (-1, 1))
            ]
        )
        j = rng.choice([i + d for d in (-1, 1) if 0 <= i + d < len(digits) and digits[i + d] != digits[i]])
        digits[i] = digits[j]
        text = "".join(digits)
    elif kind == "carry":
        text = str(max(0, int(answer) + rng.choice([-1, 1]) * rng.choice([1, 10, 100, 1000])))
    elif kind == "drop":
        i = rng.randrange(len(digits))
        text = "".join(digits[:i] + digits[i + 1 :])
    elif kind == "extra":
        i = rng.randrange(len(digits) + 1)
        text = "".join(digits[:i] + [rng.choice("0123456789")] + digits[i:])
    elif kind == "swap" and len(set(digits)) > 1:
        i, j = rng.sample(range(len(digits)), 2)
        digits[i], digits[j] = digits[j], digits[i]
        text = "".join(digits)
    elif kind == "random":
        text = str(rng.randint(10 ** (len(answer) - 1), 10 ** len(answer) - 1))
    elif kind == "stray":
        text = answer[: rng.randrange(len(answer) + 1)] + "".join(rng.choice(STRAY) for _ in range(rng.randint(1, 3)))
    else:
        text = ""
    return text if not answers_match(text, answer) else wrong_response(answer, rng, mix)


def judge_cases(addition_rows: list[dict], seed: int, mix: str) -> list[tuple[str, str, str, str]]:
    """(question, reference, response, label) per addition row: a right or wrong response with equal odds,
    labelled "yes"/"no" by the rule: what a run's GenRM asks the judge, and the verdict the rule gives."""
    rng = random.Random(seed)
    cases = []
    for row in addition_rows:
        answer = row["answer"]
        if rng.random() < 0.5:
            response = answer if rng.random() < 0.9 else rng.choice([" ", ""]) + answer + rng.choice([" ", ""])
        else:
            response = wrong_response(answer, rng, mix)
        cases.append((row["prompt"], answer, response, "yes" if answers_match(response, answer) else "no"))
    return cases


def judge_rows(addition_rows: list[dict], seed: int, mix: str, template: str = QUICKSTART_TEMPLATE) -> list[dict]:
    """One SFT row per case of `judge_cases`: the judge template filled in, answered with the rule's verdict."""
    return [
        {"prompt": render(template, question, reference, response), "answer": label, "data_source": "exact_match"}
        for question, reference, response, label in judge_cases(addition_rows, seed, mix)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the quickstart judge's SFT and held-out rows.")
    parser.add_argument("--out", default="data/addition", help="folder with sft.jsonl and eval.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    for mix in MIXES:
        for source, seed in (("sft", args.seed), ("eval", args.seed + 1)):
            target = out / f"judge_{source}_{mix}.jsonl"
            rows = judge_rows(read_jsonl(out / f"{source}.jsonl"), seed, mix)
            write_jsonl(target, rows)
            print(f"wrote {len(rows)} rows to {target}")


if __name__ == "__main__":
    main()
