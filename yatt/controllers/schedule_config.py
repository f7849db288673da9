"""The `rollout.schedule` section: when a step's rollouts are generated (yatt.controllers.schedule builds it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from yatt.config_loading import Section


class ScheduleConfig(Section):
    """When a step's rollouts are generated relative to the updates that train on them (docs/async.md)."""

    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="sync: generate, train, push the weights, one after the other. one_step_off: a producer "
        "thread per controller generates the next step's batch while the trainer trains (async with "
        "max_staleness 1). async: up to max_staleness steps ahead.",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="async: step s trains on rollouts generated with the weights of step s - 1 - max_staleness "
        "(0: sync's rollouts, exactly); the bound is on the weights a batch starts with.",
    )
    in_flight: Literal["finish", "resume"] = Field(
        "finish",
        description="one_step_off/async: what a weight push does to the requests in flight. finish: they finish "
        "on the old weights before the push (a batch is one version; runs are reproducible). resume: they are "
        "interrupted, the push happens, and they resume on the new weights with the tokens they have (partial "
        "rollouts; each token's version is kept; thread timing decides where the cut falls).",
    )
