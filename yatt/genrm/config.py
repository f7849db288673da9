"""Config of a generative reward model (GenRM) judge, of a distillation teacher, and the `reward` section that mixes
judges with the rule verifiers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from yatt.config_loading import Section
from yatt.engines.config import EngineConfig
from yatt.genrm.mixing import MixMode
from yatt.genrm.template import check_template
from yatt.genrm.verdict import ScoreVerdict, YesNoVerdict
from yatt.registry import is_import_path

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


class TeacherConfig(BaseModel):
    """On-policy distillation's teacher (yatt.genrm.teacher): a causal LM served and placed like a judge, which
    scores the student's own samples token by token instead of giving a verdict. It must share the policy's
    tokenizer (it reads the student's token ids); it may be larger. What its log-probs become is the advantage
    estimator's business (algorithm.advantage.kind: distill)."""

    model_config = ConfigDict(extra="forbid")

    model: Path = Field(description="Local Hugging Face model folder of the teacher (the policy's tokenizer).")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="The teacher's engine processes (max_model_len null: the model's context, which must hold "
        "prompt + response + 1).",
    )


class RewardConfig(Section):
    kind: MixMode = Field(
        "rule",
        description="rule: the verifier chosen by each row's data_source; genrm: the judges' weighted "
        "mean; genrm_with_rule: the weighted mean of the rule score (rule_weight) and the judges.",
    )
    rule_weight: float = Field(1.0, ge=0.0, description="Weight of the rule score in genrm_with_rule.")
    judges: list[JudgeConfig] = Field(default_factory=list, description="Generative reward models (GenRM).")
    teacher: TeacherConfig | None = Field(
        None,
        description="On-policy distillation: a teacher engine that returns per-token log-probs of every sample, "
        "served on the genrm devices like a judge; read by algorithm.advantage.kind=distill (docs/distillation.md).",
    )
    verifiers: dict[str, str] = Field(
        default_factory=dict,
        description="Your own rule verifiers by data_source "
        "name, e.g. {my_task: 'my_pkg.rewards:score'}: rows whose data_source is "
        "my_task are scored by score(response, row) -> float in [0, 1]. Imported when "
        "the run reads its data (yatt.rewards.rules), not when the config is checked.",
    )

    @field_validator("verifiers")
    @classmethod
    def _import_paths(cls, verifiers: dict[str, str]) -> dict[str, str]:
        for name, path in verifiers.items():
            if not is_import_path(path):
                raise ValueError(f"reward.verifiers.{name}: {path!r} is not an import path 'pkg.module:function'")
        return verifiers

    @model_validator(mode="after")
    def _judges_match_kind(self) -> RewardConfig:
        if self.kind != "rule" and not self.judges:
            raise ValueError(f"reward.kind={self.kind} needs at least one entry in reward.judges")
        names = [j.name for j in self.judges]
        if len(set(names)) != len(names):
            raise ValueError(f"judge names must be unique, got {names}")
        return self
