"""Rule verifiers: response text + prompt row -> score in [0, 1]. Chosen by the row's data_source.

A data_source names an entry of `RULES` (exact_match, addition, last_number, and what `reward.verifiers` adds),
or `reasoning_gym/<dataset>` (that dataset's own scorer), or `verifiers/<taskset>` (an environment package's task:
its reward is the environment's own, which the agent loop carries on the rollout), or is itself an import path
'pkg.module:function'. `score_rollout` is a rollout's rule score: the environment's reward when its loop set one.
`use_verifiers` registers reward.verifiers and checks that every row's data_source has a verifier when the run
reads its data (yatt.data.prepare), before any engine starts; scoring then only looks them up.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

from yatt.data.errors import DataError
from yatt.data.gym import GYM_PREFIX
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow
from yatt.envs.verifiers_env import ENV_PREFIX
from yatt.registry import Registry

Verifier = Callable[[str, PromptRow], float]


def answers_match(response: str, answer: str) -> bool:
    """The exact-match rule on text: the stripped response equals the stripped answer."""
    return response.strip() == answer.strip()


def exact_match(response: str, row: PromptRow) -> float:
    """1 if the stripped response equals the reference answer."""
    return float(row.answer is not None and answers_match(response, row.answer))


def last_number(response: str, row: PromptRow) -> float:
    """1 if the last number in the response equals the (numeric) reference answer."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response.replace(",", ""))
    if not numbers or row.answer is None:
        return 0.0
    try:
        return float(abs(float(numbers[-1]) - float(row.answer)) < 1e-6)
    except ValueError:
        return 0.0


@cache
def _gym_scorer(dataset: str) -> Callable:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def reasoning_gym_score(response: str, row: PromptRow) -> float:
    entry = {"question": row.question(), "answer": row.answer, "metadata": row.metadata}
    return float(_gym_scorer(row.data_source[len(GYM_PREFIX) :])(answer=response.strip(), entry=entry))


def environment_reward(response: str, row: PromptRow) -> float:
    """A verifiers task's rows have no rule: the environment scores the episode (Rollout.env_reward)."""
    raise ValueError(
        f"{row.where}: its reward is the environment's own, which the rollout.agent.kind=verifiers loop sets; "
        "this rollout has none"
    )


RULES: Registry = Registry(
    "data_source", {"exact_match": exact_match, "addition": exact_match, "last_number": last_number}
)


def get_verifier(data_source: str) -> Verifier:
    if data_source.startswith(GYM_PREFIX):
        return reasoning_gym_score
    if data_source.startswith(ENV_PREFIX):
        return environment_reward
    if data_source not in RULES:
        raise ValueError(
            f"no verifier for data_source {data_source!r}; registered: {', '.join(RULES)}, "
            f"{GYM_PREFIX}<dataset>, a name in reward.verifiers, or an import path 'pkg.module:function'"
        )
    return RULES.get(data_source)


def use_verifiers(verifiers: dict[str, str], rows: list[PromptRow]) -> None:
    """Register reward.verifiers ({data_source: 'pkg.module:function'}), importing each now, and check that
    every row's data_source names a verifier (an import path is imported too). Raises DataError naming the
    field (reward.verifiers.<name>) or the first row of a data_source without one."""
    for name, path in verifiers.items():
        try:
            RULES.register(name, RULES.get(path, f"reward.verifiers.{name}"))
        except ValueError as err:
            raise DataError(str(err)) from None
    for source, row in {r.data_source: r for r in reversed(rows)}.items():  # each source's first row
        try:
            get_verifier(source)
        except ValueError as err:
            raise DataError(f"{row.where}: {err}") from None


def score(response: str, row: PromptRow) -> float:
    return get_verifier(row.data_source)(response, row)


def score_rollout(rollout: Rollout) -> float:
    """A rollout's rule score: the environment's own reward when an agent loop set one (Rollout.env_reward),
    else the verifier of its row's data_source on its text."""
    return rollout.env_reward if rollout.env_reward is not None else score(rollout.text, rollout.row)
