"""reasoning-gym's generated tasks as a verifiers (v1) environment: one question, one reply, scored by
reasoning-gym's own scorer for the dataset.

Written as verifiers' environments are (a package exporting its `Taskset` via `__all__`, its tasks scored by
`@vf.reward` / `@vf.metric` functions over the rollout's trace), so any verifiers-v1 runner plays it. Install it
(`pip install ./environments/vf-reasoning-gym`) and name it by id: `taskset: {id: vf-reasoning-gym, dataset:
basic_arithmetic, ...}`. It has no `Env` of its own, so it runs as verifiers' `SingleAgentEnv`: the task's prompt,
the model's reply, the scoring.

`answer` says which part of the reply is the answer reasoning-gym scores: the whole reply (`reply`, the default),
or its last number (`last_number`), for small chat models that answer in a sentence ("48 + 16 = 64").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

import reasoning_gym
import verifiers.v1 as vf
from pydantic import Field

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class GymData(vf.TaskData):
    entry: dict[str, Any]
    """reasoning-gym's item: question, answer and metadata (the scorer reads all three)."""
    answer_from: Literal["reply", "last_number"] = "reply"
    """Which part of the reply is scored as the answer."""


class GymTask(vf.Task[GymData]):
    @vf.stop
    async def answered(self, trace: vf.Trace) -> bool:
        """One reply per question (verifiers' single-turn convention)."""
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """reasoning-gym's score of the answer: 1.0 when right (some datasets give partial credit)."""
        answer = extract(trace.last_reply, self.data.answer_from)
        score = reasoning_gym.get_score_answer_fn(self.data.entry["metadata"]["source_dataset"])
        return float(score(answer, self.data.entry)) if answer is not None else 0.0

    @vf.metric
    async def has_answer(self, trace: vf.Trace) -> float:
        """Whether the reply held an answer at all (a number, for `last_number`)."""
        return float(extract(trace.last_reply, self.data.answer_from) is not None)


class GymConfig(vf.TasksetConfig):
    dataset: str
    """A reasoning-gym dataset name, e.g. basic_arithmetic."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The dataset's own config fields (reasoning_gym.create_dataset keyword arguments)."""
    size: int = Field(1000, gt=0)
    seed: int = 0
    instruction: str = "{question}"
    """The prompt, with {question} the item's question."""
    answer_from: Literal["reply", "last_number"] = "reply"


class GymTaskset(vf.Taskset[GymTask, GymConfig]):
    def load(self) -> Iterator[GymTask]:
        config = self.config
        items = reasoning_gym.create_dataset(config.dataset, size=config.size, seed=config.seed, **config.options)
        for i, entry in enumerate(items):
            yield GymTask(
                GymData(
                    name=f"{config.dataset}#{i}",
                    prompt=config.instruction.format(question=entry["question"]),
                    entry=entry,
                    answer_from=config.answer_from,
                ),
                config.task,
            )


def extract(reply: str, answer_from: str) -> str | None:
    if answer_from == "reply":
        return reply.strip() or None
    numbers = NUMBER.findall(reply.replace(",", ""))
    return numbers[-1] if numbers else None


__all__ = ["GymTaskset"]
