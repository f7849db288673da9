"""The `balance` section: moving rollouts between data-parallel ranks (yatt.balance.exchange)."""

from __future__ import annotations

from pydantic import Field, field_validator

from yatt.balance.partition import PARTITIONERS
from yatt.config_loading import Section


class BalanceConfig(Section):
    """Moving rollouts between data-parallel ranks so each trains about the same work."""

    enabled: bool = Field(False, description="Rebalance rollouts across ranks after rewards, before logprobs.")
    attention_coef: float = Field(
        0.0,
        ge=0.0,
        description="Workload per sample is L + attention_coef * L^2 "
        "(L = prompt + response tokens); raise it when attention dominates.",
    )
    partitioner: str = Field(
        "kk",
        description="kk: Karmarkar-Karp; greedy: LPT (yatt.balance.partition); or an "
        "import path 'pkg.module:function' taking (weights, k, equal_count=).",
    )
    equal_count: bool = Field(False, description="Also give every rank the same number of units (+-1).")
    keep_groups: bool | None = Field(
        None,
        description="Move whole groups (all samples of a prompt); None: "
        "when the advantage estimator needs them (grpo does).",
    )

    @field_validator("partitioner")
    @classmethod
    def _known_partitioner(cls, value: str) -> str:
        return PARTITIONERS.check(value)
