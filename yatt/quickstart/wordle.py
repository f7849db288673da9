"""Scripted Wordle games for a format warm-up of an environment run (configs/sft_smollm2_wordle.yaml).

Zero-shot, SmolLM2-135M-Instruct never writes a valid Wordle guess, so every game scores 0 and GRPO has nothing
to learn from. This writes games of verifiers' TextArena Wordle taskset played by a scripted player: each turn
it guesses a word drawn (seeded by the task) from the game's secret-word list among those consistent with the
feedback so far, written as the game asks (``[crane]``). The games are played through the environment itself
(yatt.envs.episode), so the feedback is the package's own, and each row is the task's row (its messages and
task metadata, as the `kind: verifiers` data source reads it) with the guesses as its answer, each ended by the
tokenizer's end-of-sequence text: launch/sft.py replays them through the run's environment loop.

    python -m yatt.quickstart.wordle --out data/wordle --nltk-data data/nltk_data [--eos '<|im_end|>']
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from yatt.data.rows import PromptRow
from yatt.envs.episode import run_episode
from yatt.envs.verifiers_env import offline_nltk, read_task_shard, task_of

GAME = {"game": "Wordle-v0"}
FEEDBACK = re.compile(r"^([A-Z](?: [A-Z])*)\n([GYX](?: [GYX])*)$", re.MULTILINE)


def marks(guess: str, secret: str) -> str:
    """Wordle's feedback of `guess` for `secret` (G, Y, X per letter; a repeated letter is yellow only as often as
    the secret has it unmatched), as TextArena's WordleEnv computes it."""
    out, rest = ["X"] * len(guess), list(secret)
    for i, (g, s) in enumerate(zip(guess, secret)):
        if g == s:
            out[i], rest[i] = "G", None
    for i, g in enumerate(guess):
        if out[i] == "X" and g in rest:
            out[i] = "Y"
            rest[rest.index(g)] = None
    return "".join(out)


class Player:
    """Guesses a random word of `words` consistent with every (guess, feedback) seen so far."""

    def __init__(self, words: list[str], seed: int):
        # not the task's own seed: the game draws its secret from the same list with random.seed(task seed)
        self.candidates, self.rng, self.guesses = sorted(words), random.Random(f"player {seed}"), []

    def __call__(self, message: str | None) -> str:
        if message is not None:
            found = FEEDBACK.findall(message)
            if not found:
                raise ValueError(f"no Wordle feedback in the environment's turn: {message!r}")
            word, feedback = found[-1][0].replace(" ", "").lower(), found[-1][1].replace(" ", "")
            self.candidates = [w for w in self.candidates if w != word and marks(word, w) == feedback]
        guess = self.rng.choice(self.candidates)
        self.guesses.append(guess)
        return f"[{guess}]"


def secret_words(nltk_data: Path) -> list[str]:
    """The game's secret-word list (TextArena's WordleEnv: five-letter nouns of the basic English list)."""
    offline_nltk(nltk_data)
    from textarena.envs.Wordle.env import WordleEnv

    return list(dict.fromkeys(WordleEnv().word_list))


def scripted_row(row: PromptRow, words: list[str], eos: str) -> tuple[dict, float]:
    """A task's row played to its end by the scripted player: the JSONL record and the game's reward."""
    env, task = task_of(row)
    player = Player(words, seed=row.index)
    record = run_episode(env, task, player)
    answer = "".join(f"[{g}]{eos}" for g in player.guesses)
    return {
        "messages": row.messages,
        "answer": answer,
        "data_source": row.data_source,
        "metadata": row.metadata,
    }, record.reward


def write_split(path: Path, start: int, size: int, nltk_data: Path, words: list[str], eos: str) -> list[float]:
    rows = read_task_shard("textarena", GAME, start, size, 0, 1, nltk_data=nltk_data)
    rewards = []
    with open(path, "w") as f:
        for k, row in enumerate(rows):
            record, reward = scripted_row(row, words, eos)
            f.write(json.dumps(record) + "\n")
            rewards.append(reward)
            if (k + 1) % 50 == 0:
                print(f"  {path.name}: {k + 1}/{len(rows)} games", flush=True)
    return rewards


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for sft.jsonl and eval.jsonl")
    parser.add_argument("--nltk-data", type=Path, required=True, help="folder of python -m yatt.envs.nltk_data")
    parser.add_argument("--train", type=int, default=256, help="games to learn from (tasks 0 ..)")
    parser.add_argument("--eval", type=int, default=32, help="held-out games (tasks 50000 .., the run's eval)")
    parser.add_argument("--eos", default="<|im_end|>", help="the policy tokenizer's end-of-sequence text")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    words = secret_words(args.nltk_data)
    for name, start, size in (("sft", 0, args.train), ("eval", 50000, args.eval)):
        rewards = write_split(args.out / f"{name}.jsonl", start, size, args.nltk_data, words, args.eos)
        won = sum(r >= 1 for r in rewards)
        print(
            f"{args.out / name}.jsonl: {len(rewards)} games, {won} won by the scripted player, "
            f"mean reward {sum(rewards) / len(rewards):.3f}"
        )


if __name__ == "__main__":
    main()
