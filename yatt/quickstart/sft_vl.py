"""Supervised warm-up of the tiny vision-language policy on an image task, stopped on held-out accuracy.

Like `yatt.quickstart.sft` for text, but each row's images go through the policy's processor (the same
expansion engines and the trainer use, yatt.models.vision) and the loss covers the answer and the
end-of-sequence token. This is a single-process tool for the small quickstart data, so it loads every image
up front; RL runs read images per rank and per step instead (yatt.controllers.images).

    python -m yatt.quickstart.sft_vl --data data/shapes --out models/quickstart-vl [--stop-at 0.3]

Why answer-balanced batches and a per-answer stop (the defaults): RL can only reinforce answers the policy
samples. On the shapes task plain batches teach the majority answers first (0 and 1), and a policy stopped there
answers 2 and 3 with near-zero probability; GRPO then sharpens 0/1 and never recovers the rest. Batches that
draw each gold answer equally often make the vision features separate every count early, and stopping at the
first eval where every gold answer is also answered right on some rows (`--min-answer-accuracy`) hands RL a
policy that is weak overall but samples every answer.
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from yatt.data.images import read_image_bytes
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.prepare import encode_prompts
from yatt.models.tiny_vl import TinyVLConfig, write_tiny_vl_model
from yatt.models.vision import ImageInputs, load_policy
from yatt.rewards.rules import score


def encode_split(path: Path, inputs: ImageInputs, limit: int | None = None):
    """(rows, expanded prompt ids, pixel tensors [N, ...]) of a JSONL split with one image layout."""
    rows = read_jsonl_shard([path], 0, 1, limit=limit)
    tok = inputs.processor.tokenizer
    prompts, pixels = [], []
    for row, ids in zip(rows, encode_prompts(rows, tok, 1 << 16)):
        expanded, pix = inputs.encode(ids, [read_image_bytes(ref, row.where) for ref in row.images], row.where)
        prompts.append(expanded)
        pixels.append(pix)
    return rows, prompts, {k: torch.cat([p[k] for p in pixels]) for k in pixels[0]}


def _left_padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = torch.tensor(s), 1
    return ids, mask


def verified(text: str, row) -> bool:
    """The row's verifier gives the answer full marks."""
    return score(text, row) >= 1.0


@torch.no_grad()
def greedy_correct(model, tok, rows, prompts, pixels, max_new_tokens: int = 3, correct=verified) -> list[bool]:
    """Whether each row's greedy answer (full recompute per token: prompts are short) is `correct(text, row)`
    (default: passes its verifier)."""
    model.eval()
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    answers: list[list[int]] = [[] for _ in seqs]
    for _ in range(max_new_tokens):
        ids, mask = _left_padded(seqs, tok.pad_token_id)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), **pixels
        ).logits[:, -1]
        for i, t in enumerate(logits.argmax(-1).tolist()):
            if not done[i]:
                seqs[i].append(t)
                answers[i].append(t)
                done[i] = t == tok.eos_token_id
    model.train()
    return [correct(tok.decode(a, skip_special_tokens=True), r) for r, a in zip(rows, answers)]


def greedy_accuracy(model, tok, rows, prompts, pixels, max_new_tokens: int = 3) -> float:
    right = greedy_correct(model, tok, rows, prompts, pixels, max_new_tokens)
    return sum(right) / len(rows)


def per_answer_accuracy(rows, right: list[bool]) -> dict[str, float]:
    """Greedy accuracy on the rows of each gold answer."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for row, ok in zip(rows, right):
        groups[row.answer].append(ok)
    return {answer: sum(oks) / len(oks) for answer, oks in sorted(groups.items())}


def balanced_sampler(rows, rng: random.Random):
    """Draws row indices so that every gold answer is equally likely (then a uniform row of that answer)."""
    by_answer: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_answer[row.answer].append(i)
    answers = sorted(by_answer)
    return lambda n: [rng.choice(by_answer[rng.choice(answers)]) for _ in range(n)]


def sft_loss(model, tok, prompts, answers, pixels) -> torch.Tensor:
    """Cross-entropy of answer + eos given prompt and image (right-padded batch)."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        mask[i, : len(p) + len(a)] = 1
    logits = model(input_ids=ids, attention_mask=mask, **pixels).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100)


def run_sft_vl(
    data: Path,
    out: Path,
    stop_at: float = 0.3,
    lr: float = 1e-3,
    batch_size: int = 64,
    max_steps: int = 3000,
    eval_every: int = 10,
    eval_rows: int = 200,
    seed: int = 0,
    balanced: bool = True,
    min_answer_accuracy: float = 0.1,
    log=print,
    train_file: str = "sft.jsonl",
    eval_file: str = "eval.jsonl",
    model: TinyVLConfig | None = None,
    max_new_tokens: int = 3,
    correct=verified,
) -> dict:
    """Train until an eval has greedy accuracy >= stop_at and, on the rows of every gold answer, greedy
    accuracy >= min_answer_accuracy (0 disables that part). balanced: answer-balanced batches. `train_file`,
    `eval_file`: JSONL files in `data`; `model`: the tiny VL model's shape (default TinyVLConfig());
    `max_new_tokens`, `correct(text, row)`: of the greedy evaluation."""
    torch.manual_seed(seed)
    work = out.with_name(out.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    write_tiny_vl_model(work, model or TinyVLConfig(), seed=seed)
    inputs = ImageInputs(work)
    tok = inputs.processor.tokenizer
    model = load_policy(work, dtype=torch.float32).train()
    rows, prompts, pixels = encode_split(data / train_file, inputs)
    answers = [tok(r.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    e_rows, e_prompts, e_pixels = encode_split(data / eval_file, inputs, limit=eval_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    draw = balanced_sampler(rows, rng) if balanced else (lambda n: rng.sample(range(len(rows)), n))
    start, history, acc = time.perf_counter(), [], 0.0
    for step in range(1, max_steps + 1):
        pick = draw(batch_size)
        loss = sft_loss(
            model, tok, [prompts[i] for i in pick], [answers[i] for i in pick], {k: v[pick] for k, v in pixels.items()}
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0:
            right = greedy_correct(model, tok, e_rows, e_prompts, e_pixels, max_new_tokens, correct)
            acc, per_answer = sum(right) / len(right), per_answer_accuracy(e_rows, right)
            history.append({"step": step, "loss": float(loss.detach()), "accuracy": acc, "per_answer": per_answer})
            log(
                f"sft-vl step {step:5d} loss {float(loss.detach()):.3f} eval accuracy {acc:.3f} per answer "
                f"{ {a: round(v, 2) for a, v in per_answer.items()} } ({time.perf_counter() - start:.0f}s)"
            )
            if acc >= stop_at and min(per_answer.values()) >= min_answer_accuracy:
                break
    model.save_pretrained(work)
    inputs.processor.save_pretrained(work)
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)
    return {"steps": step, "accuracy": acc, "seconds": time.perf_counter() - start, "history": history}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="SFT the tiny VL policy on an image task (e.g. data/shapes).")
    parser.add_argument("--data", type=Path, default=Path("data/shapes"))
    parser.add_argument("--out", type=Path, default=Path("models/quickstart-vl"))
    parser.add_argument("--stop-at", type=float, default=0.3, help="stop at this held-out greedy accuracy...")
    parser.add_argument(
        "--min-answer-accuracy",
        type=float,
        default=0.1,
        help="...once the rows of every gold answer also reach this greedy accuracy (0: off)",
    )
    parser.add_argument("--plain-batches", action="store_true", help="uniform rows instead of answer-balanced")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        print(f"{args.out} exists; delete it to train again")
    else:
        result = run_sft_vl(
            args.data,
            args.out,
            args.stop_at,
            lr=args.lr,
            max_steps=args.max_steps,
            eval_every=args.eval_every,
            seed=args.seed,
            balanced=not args.plain_batches,
            min_answer_accuracy=args.min_answer_accuracy,
        )
        print({k: v for k, v in result.items() if k != "history"})
