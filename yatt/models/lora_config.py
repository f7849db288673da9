"""`model.lora`: train low-rank adapters instead of every weight (docs/lora.md).

Light on purpose (pydantic only): the config is checked without importing torch or peft, which
`yatt.trainers.lora` uses when the trainer is built.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class LoRAConfig(BaseModel):
    """LoRA adapters (peft) on the policy's linear layers: W x + (alpha / rank) B A x, with A [rank, in] random and
    B [out, rank] zero at the start, so the first step's policy is the base model. Only A and B train."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(
        0,
        ge=0,
        description="Adapter rank r; 0: off (every weight trains). With r > 0 the base weights are frozen, the "
        "optimizer holds only the adapters, checkpoints hold only the adapters and their optimizer state, and "
        "the reference model (algorithm.kl_coef > 0) is the policy with its adapter switched off, not a copy.",
    )
    alpha: float = Field(32.0, gt=0.0, description="Scale of the adapter's output: alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input in the policy's forwards, its log-prob passes included (the "
        "trainer keeps the model in training mode), so old log-probs are of a dropped-out forward too; 0: none.",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Linear layers that get adapters: 'all-linear' (every linear layer of the decoder, not the "
        "output head) or module names such as [q_proj, k_proj, v_proj, o_proj] (peft's target_modules).",
    )
    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="What the weight sync sends the rollout engines. merged: base + B A x alpha / rank of the "
        "adapted layers only, computed on the trainer (any engine). adapter: A and B only, for an engine backend "
        "that declares it: hf merges them into its own copy of those base weights, vllm serves them with its "
        "LoRA layers.",
    )

    @field_validator("target_modules")
    @classmethod
    def _named(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("target_modules is empty; name the linear layers or use 'all-linear'")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def adapter_rank(self) -> int | None:
        """The rank of the adapters the weight sync sends the engines (sync: adapter); None: it sends weights."""
        return self.rank if self.enabled and self.sync == "adapter" else None

    @property
    def scaling(self) -> float:
        """What multiplies B A: alpha / rank (peft's `scaling`)."""
        return self.alpha / self.rank
