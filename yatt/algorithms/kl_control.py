"""The KL coefficient over a run: fixed, or adapted towards a target KL (Ziegler et al. 2019, "Fine-Tuning
Language Models from Human Preferences", section 2.2; the controller veRL and TRL call AdaptiveKLController)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Ziegler et al. clip the proportional error so one outlier step moves the coefficient by at most 20% x n/horizon.
ERROR_CLIP = 0.2


class KLControlConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="fixed: the coefficient stays algorithm.kl_coef. adaptive: it starts at kl_coef and "
        "is multiplied after every step by 1 + clip(kl / target_kl - 1, -0.2, 0.2) * samples / horizon.",
    )
    target_kl: float = Field(
        0.01,
        gt=0.0,
        description="adaptive: the per-token KL to the reference (the "
        "actor/kl_ref metric, in the algorithm.kl_estimator's units) to steer towards.",
    )
    horizon: float = Field(
        10_000,
        gt=0.0,
        description="adaptive: samples over which a persistent 20% error "
        "changes the coefficient by a factor of about e^0.2 (larger: slower).",
    )


class KLController:
    """Holds the current coefficient; `update` after each step with the measured KL; checkpointed."""

    def __init__(self, init_coef: float, cfg: KLControlConfig):
        self.cfg, self.coef = cfg, init_coef

    def update(self, kl: float, samples: float) -> None:
        """`kl`: this step's mean per-token KL over all ranks; `samples`: the step's global sample count."""
        if self.cfg.kind == "fixed":
            return
        error = min(max(kl / self.cfg.target_kl - 1.0, -ERROR_CLIP), ERROR_CLIP)
        self.coef *= 1.0 + error * samples / self.cfg.horizon

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
