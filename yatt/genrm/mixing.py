"""Reward mixing: rule score and judge scores -> one reward per sample (pure math)."""

from __future__ import annotations

from typing import Literal

import torch

MixMode = Literal["rule", "genrm", "genrm_with_rule"]


def mix_rewards(
    mode: MixMode,
    rule: torch.Tensor | None,
    judges: dict[str, torch.Tensor],
    judge_weights: dict[str, float],
    rule_weight: float = 1.0,
) -> torch.Tensor:
    """Weighted mean of the chosen parts.

    rule: the rule verifier alone. genrm: weighted mean of the judges. genrm_with_rule: weighted
    mean of the rule score (weight `rule_weight`) and the judges.
    """
    if mode == "rule":
        if rule is None:
            raise ValueError("mode 'rule' needs rule scores")
        return rule.clone()
    if not judges:
        raise ValueError(f"mode {mode!r} needs at least one judge's scores")
    missing = set(judges) - set(judge_weights)
    if missing:
        raise ValueError(f"no weight for judge(s) {sorted(missing)}")
    total = sum(judge_weights[name] * scores for name, scores in judges.items())
    weight = sum(judge_weights[name] for name in judges)
    if mode == "genrm_with_rule":
        if rule is None:
            raise ValueError("mode 'genrm_with_rule' needs rule scores")
        total = total + rule_weight * rule
        weight += rule_weight
    if weight <= 0:
        raise ValueError("reward weights must sum to a positive number")
    return total / weight


def mean_over_repeats(verdicts: list[float | None], unparseable_score: float) -> tuple[float, int]:
    """The mean verdict over a response's repeats (unreadable ones score the fallback) and the unreadable count."""
    bad = sum(v is None for v in verdicts)
    values = [unparseable_score if v is None else v for v in verdicts]
    return sum(values) / len(values), bad
