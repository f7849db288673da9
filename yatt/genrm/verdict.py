"""Verdict parsers: the judge's generated text -> a score, or None when it cannot be read.

Only the judge's *output* is parsed, never the prompt: the policy's response sits inside the
prompt, so text such as "Yes" or "Score: 10" written by the policy cannot become a verdict.
An unreadable verdict is `None`; the caller scores it with the configured fallback and counts it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_WORD = re.compile(r"[A-Za-z]+")


class YesNoVerdict(BaseModel):
    """The verdict is the first word of the output: yes -> `yes_score`, no -> `no_score` (case-insensitive).

    An output whose first word is neither, or that also contains the opposite word (e.g.
    "No, wait, yes"), is unreadable: a hedged verdict is not a verdict.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["yes_no"] = "yes_no"
    # Not named `yes`/`no`: YAML reads those keys as booleans.
    yes_score: float = Field(1.0, description="Score of a Yes verdict.")
    no_score: float = Field(0.0, description="Score of a No verdict (e.g. -1 for a symmetric +1/-1 reward).")

    def parse(self, output: str) -> float | None:
        words = [w.lower() for w in _WORD.findall(output)]
        if not words or words[0] not in ("yes", "no"):
            return None
        other = "no" if words[0] == "yes" else "yes"
        if other in words[1:]:
            return None
        return self.yes_score if words[0] == "yes" else self.no_score

    @property
    def pass_threshold(self) -> float:
        """Scores above this count as "judged correct" (for agreement with the rule verifier)."""
        return (self.yes_score + self.no_score) / 2


class ScoreVerdict(BaseModel):
    """The verdict is the number after the last `Score:` in the output, which must lie in [low, high].

    The score is mapped linearly to [0, 1] when `normalize` is on, so judges on different scales mix.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["score"] = "score"
    low: float = Field(0.0, description="Smallest valid score.")
    high: float = Field(10.0, description="Largest valid score.")
    normalize: bool = Field(True, description="Map [low, high] to [0, 1].")

    def parse(self, output: str) -> float | None:
        found = re.findall(r"score\s*:\s*(-?\d+(?:\.\d+)?)", output, flags=re.IGNORECASE)
        if not found:
            return None
        value = float(found[-1])
        if not self.low <= value <= self.high:
            return None
        return (value - self.low) / (self.high - self.low) if self.normalize else value

    @property
    def pass_threshold(self) -> float:
        return 0.5 if self.normalize else (self.low + self.high) / 2


Verdict = YesNoVerdict | ScoreVerdict
