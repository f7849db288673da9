"""The visual quickstart's judge (GenRM): a tiny VL model that looks at the image and says whether a count is right.

A judge row is (the shapes image, the question, a candidate answer) -> "<count> yes|no": the judge first says
how many squares of the colour it sees, then its verdict, labelled by the exact-match rule against the row's
answer, so a judge that learns the rows agrees with the rule. The verdict parser (`yes_no`) reads the first
word, and a count is no word. The judge is not shown the reference answer (the template has no {reference}): it
has to count the squares itself, which is what a vision-language judge is for. Each shapes row gives one right
candidate and two wrong ones (one in the held-out rows): another count; the answer with characters around it;
any short string.

What made it a judge GRPO cannot game (measured on 2 CPU cores, 200 held-out images x 9 candidates):
- Count first: trained to say yes/no alone, the 0.5M model stayed at 0.71 held-out accuracy after 1500 steps
  (it has to count and compare in one token); the same model learns to count to 0.99 in 350 steps, and with
  its count written out the verdict compares two tokens.
- Padded and junk candidates: a judge that had only seen one-off counts and two-character mistakes said yes to
  "1111" for a count of 1, and GRPO found that within 50 steps (judge/rule agreement 0.20, responses grew to
  the 4-token limit). A policy learns whatever its judge lets through.
- Every wrong count equally likely, and a stop at 0.995: with half of the wrong counts one off the judge said
  yes to 15% of wrong counts (nearly all two off, the pairs it saw least); with uniform ones stopped at 0.98,
  6%; stopped at 0.995 (950 steps, 131 s), 1.5%, and no to every padded answer.

The prompt is exactly what `Judge.request` builds at run time from TEMPLATE (the question without its image
marker, one placeholder at {images}), and the judge is trained by the VL policy's warm-up code
(yatt.quickstart.sft_vl.run_sft_vl) with batches balanced over its gold outputs ("<count> yes|no"), stopped
on held-out judge accuracy (the verdict's; yatt.quickstart.shapes_judge.same_verdict).

    python -m yatt.quickstart.shapes_judge --data data/shapes --out models/quickstart-vl-judge

writes judge_sft.jsonl and judge_eval.jsonl next to the shapes rows (once), then trains the judge.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from yatt.data.images import IMAGE_PLACEHOLDER
from yatt.genrm.template import render
from yatt.genrm.verdict import YesNoVerdict
from yatt.models.tiny import DEFAULT_ALPHABET
from yatt.models.tiny_vl import TinyVLConfig
from yatt.rewards.rules import answers_match

TEMPLATE = "{images}{question}:{response}?"  # reward.judges[].template of configs/quickstart_vl_genrm.yaml
COUNTS = "01234"  # a 2 x 2 grid shows 0 to 4 squares of a colour
POLICY_CHARS = DEFAULT_ALPHABET  # what the quickstart's VL policy can write
JUDGE_MODEL = TinyVLConfig()  # the policy's shape (0.5M parameters)
VERDICT = YesNoVerdict()


def same_verdict(text: str, row) -> bool:
    """The judge's greedy output has the row's verdict (its count may differ): held-out judge accuracy."""
    return VERDICT.parse(text) is not None and VERDICT.parse(text) == VERDICT.parse(row.answer)


def wrong_candidate(answer: str, rng: random.Random) -> str:
    """A response the exact-match rule rejects: another count (any of them: the judge counts for itself, so a
    near miss is no harder for it than any other count, and every pair of counts must be told apart), the
    answer with characters around it (e.g. "1111", "12", "a1": what a policy drifts to when a judge lets it),
    or any short string of the policy's characters (up to 4, its max_new_tokens)."""
    kind = rng.choices(["other", "padded", "junk"], weights=[50, 30, 20])[0]
    if kind == "other":
        text = rng.choice([c for c in COUNTS if c != answer])
    elif kind == "padded":
        text = answer
        for _ in range(rng.randint(1, 3)):
            extra = rng.choices([answer, rng.choice(COUNTS), rng.choice(POLICY_CHARS)], weights=[4, 4, 2])[0]
            text = extra + text if rng.random() < 0.5 else text + extra
    else:
        text = "".join(rng.choice(POLICY_CHARS) for _ in range(rng.randint(0, 4)))
    return text if not answers_match(text, answer) else wrong_candidate(answer, rng)


def judge_cases(shapes_rows: list[dict], seed: int, wrong: int = 1) -> list[tuple[dict, str, str]]:
    """(shapes row, response, verdict) per candidate: per row a right candidate and `wrong` wrong ones, in
    random order; the verdict is "<count> yes|no" by the rule (what the judge is taught to write)."""
    rng = random.Random(seed)
    out = []
    for row in shapes_rows:
        answer = row["answer"]
        right = answer if rng.random() < 0.9 else rng.choice([" ", ""]) + answer + rng.choice([" ", ""])
        candidates = [right] + [wrong_candidate(answer, rng) for _ in range(wrong)]
        rng.shuffle(candidates)
        out += [(row, r, f"{answer} {'yes' if answers_match(r, answer) else 'no'}") for r in candidates]
    return out


def judge_rows(shapes_rows: list[dict], seed: int, wrong: int = 1, template: str = TEMPLATE) -> list[dict]:
    """One SFT row per case of `judge_cases`: the template filled in as the run's Judge.request fills it."""
    out = []
    for row, response, verdict in judge_cases(shapes_rows, seed, wrong):
        question = row["prompt"].replace(IMAGE_PLACEHOLDER, "")  # as Judge.request: only {images} places images
        prompt = render(template, question, None, response, IMAGE_PLACEHOLDER * len(row["images"]))
        out.append({"prompt": prompt, "answer": verdict, "data_source": "exact_match", "images": row["images"]})
    return out


def write_judge_files(data: Path, seed: int = 0) -> list[Path]:
    """judge_sft.jsonl (from sft.jsonl) and judge_eval.jsonl (from eval.jsonl) in `data`, image paths shared."""
    paths = []
    for source, offset, wrong in (("sft", 0, 2), ("eval", 1, 1)):  # held out: as many right as wrong
        rows = [json.loads(line) for line in (data / f"{source}.jsonl").read_text().splitlines() if line.strip()]
        path = data / f"judge_{source}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in judge_rows(rows, seed + offset, wrong)))
        paths.append(path)
    return paths


def train_judge(data: Path, out: Path, stop_at: float = 0.995, seed: int = 0, **kw) -> dict:
    """The judge, from a fresh tiny VL model: yes/no-balanced SFT stopped at held-out judge accuracy `stop_at`."""
    from yatt.quickstart.sft_vl import run_sft_vl

    if not (data / "judge_sft.jsonl").is_file():
        write_judge_files(data, seed)
    kw = {"lr": 1e-3, "batch_size": 64, "max_steps": 3000, "eval_every": 50, "eval_rows": 400, **kw}
    kw = {"train_file": "judge_sft.jsonl", "eval_file": "judge_eval.jsonl", **kw}
    return run_sft_vl(
        data,
        out,
        stop_at,
        seed=seed,
        min_answer_accuracy=0.0,
        model=JUDGE_MODEL,
        max_new_tokens=6,
        correct=same_verdict,
        **kw,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the visual quickstart's tiny VL judge.")
    parser.add_argument("--data", type=Path, default=Path("data/shapes"))
    parser.add_argument("--out", type=Path, default=Path("models/quickstart-vl-judge"))
    parser.add_argument("--stop-at", type=float, default=0.995, help="held-out judge accuracy to stop at")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        print(f"{args.out} exists; delete it to train again")
    else:
        result = train_judge(args.data, args.out, args.stop_at, args.seed, max_steps=args.max_steps)
        print({k: v for k, v in result.items() if k != "history"})
