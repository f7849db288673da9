"""Config of a generative reward model (GenRM) judge."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from yatt.engines.config import EngineConfig
from yatt.genrm.template import check_template
from yatt.genrm.verdict import ScoreVerdict, YesNoVerdict

VerdictConfig = Annotated[YesNoVerdict | ScoreVerdict, Field(discriminator="kind")]


class JudgeConfig(BaseModel):
    """One judge: a causal LM served by an engine, asked about each response `repeats` times."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("judge", description="Names the judge in metrics and in reward.weights.")
    model: Path = Field(description="Local Hugging Face model folder of the judge.")
    template: str = Field(
        description="Judge prompt with {question}, {reference} (may be empty) and {response}; {images}: where a "
        "vision-language judge sees an image prompt's images (default: in front)."
    )
    verdict: VerdictConfig = Field(default_factory=YesNoVerdict, description="How the judge's output becomes a score.")
    repeats: int = Field(1, gt=0, description="Judgements per response; the reward is their mean.")
    temperature: float = Field(0.0, ge=0.0, description="Judge sampling temperature (0: greedy).")
    max_tokens: int = Field(8, gt=0, description="Longest judge output.")
    unparseable_score: float = Field(0.0, description="Score of an unreadable verdict (counted in metrics).")
    weight: float = Field(1.0, ge=0.0, description="Weight of this judge in the reward mix.")
    reads: Literal["final", "trajectory"] = Field(
        "final",
        description="What {response} is for a multi-turn rollout (rollout.agent): final, the last model turn; "
        "trajectory, the whole response (model turns, tool calls and tool responses) as decoded. The same for a "
        "single-turn rollout.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The judge's engine processes.")

    @field_validator("template")
    @classmethod
    def _template_fields(cls, template: str) -> str:
        return check_template(template)

    @model_validator(mode="after")
    def _derived(self) -> JudgeConfig:
        if self.repeats > 1 and self.temperature == 0.0:
            raise ValueError(
                f"judge {self.name!r}: repeats={self.repeats} with temperature 0 repeats the same "
                "greedy verdict; set temperature > 0 or repeats: 1"
            )
        return self
