"""The `placement` section: which devices serve rollout and GenRM during generation (yatt.placement.plan)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from yatt.config_loading import Section


class PlacementConfig(Section):
    mode: Literal["full", "partial"] = Field(
        "full",
        description="full: every device serves rollout, then GenRM, then training. partial: during "
        "generation some devices serve rollout while the others serve GenRM at the same time; then all train.",
    )
    rollout_devices: int | None = Field(
        None, gt=0, description="partial: rollout devices at the start (None: half of them, rounded up)."
    )
    min_rollout_devices: int = Field(1, gt=0, description="partial: lower bound of the rollout split.")
    min_genrm_devices: int = Field(1, gt=0, description="partial: lower bound of the GenRM split.")
    dynamic: bool = Field(True, description="partial: re-choose the split between steps from measured load.")
    load_smoothing: float = Field(0.5, ge=0.0, lt=1.0, description="partial: EMA factor of the measured load.")
