"""The `critic` section: the value model of PPO with a critic (see yatt.controllers.critic)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from yatt.algorithms import LOSS_AGGREGATIONS


class CriticConfig(BaseModel):
    """A value model on the trainer's backend: the policy's decoder (or `model`'s) with a scalar head per
    token. It trains on the same mini-batches as the policy, with its own AdamW and lr schedule, and
    otherwise the `trainer` section's settings (dtype, schedule shape, grad_clip, micro-batching)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(
        None,
        description="Train a critic. null: when the advantage estimator reads "
        "values (algorithm.advantage.kind: gae); true with another estimator trains and "
        "logs it without using its values (e.g. to warm one up for a later run).",
    )
    model: Path | None = Field(
        None,
        description="Hugging Face folder the critic starts from: a causal LM "
        "(its decoder; a new value head is added) or a saved one-label token-classification "
        "model. null: model.path, the policy's.",
    )
    lr: float = Field(
        1e-4,
        gt=0.0,
        description="Peak learning rate of the critic's optimizer (warm-up and "
        "decay as trainer.warmup_steps / lr_schedule / min_lr_ratio).",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="The first N RL steps train only the critic (the policy is "
        "not updated) so its values mean something before advantages use them.",
    )
    value_clip: float | None = Field(
        0.2,
        gt=0.0,
        description="A value moves at most this far from its old value "
        "in the clipped loss (PPO's value clipping); null: the plain squared error.",
    )
    loss_agg: str | None = Field(
        None,
        description="How the token losses become one (the policy's choices: "
        f"{', '.join(LOSS_AGGREGATIONS)}); null: algorithm.loss_agg.",
    )

    @field_validator("loss_agg")
    @classmethod
    def _known_agg(cls, value: str | None) -> str | None:
        return value if value is None else LOSS_AGGREGATIONS.check(value, "critic.loss_agg")
