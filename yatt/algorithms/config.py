"""The `algorithm` section: each registry's entry is chosen by `kind` and brings its own typed section
(`_section_of`); a bare name (`algorithm.advantage=rloo`) is that entry with its defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    PlainValidator,
    SerializeAsAny,
    Tag,
    field_validator,
    model_validator,
)

from yatt.algorithms import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from yatt.algorithms.base import ComponentConfig
from yatt.algorithms.grpo import GRPOConfig
from yatt.algorithms.kl_control import KLControlConfig
from yatt.algorithms.ppo_clip import PPOClipConfig
from yatt.algorithms.rollout_is import RolloutISConfig
from yatt.config_loading import Section
from yatt.registry import Registry


class DynamicSamplingConfig(Section):
    """DAPO-style dynamic sampling: train only on groups whose rewards are not all equal."""

    enabled: bool = Field(False, description="Drop all-equal-reward groups and refill from the shard's stream.")
    max_rounds: int = Field(4, gt=0, description="Generate rounds per step at most; then train on what was kept.")
    initial_oversample: float = Field(1.5, ge=1.0, description="Prompts generated per needed group, at first.")
    min_oversample: float = Field(1.0, ge=1.0, description="Lower bound of the adapted oversampling ratio.")
    max_oversample: float = Field(4.0, ge=1.0, description="Upper bound of the adapted oversampling ratio.")
    ema: float = Field(0.5, gt=0.0, le=1.0, description="Weight of the newest round's keep rate in its average.")

    @model_validator(mode="after")
    def _ordered(self) -> DynamicSamplingConfig:
        if not self.min_oversample <= self.initial_oversample <= self.max_oversample:
            raise ValueError("need min_oversample <= initial_oversample <= max_oversample")
        return self


PLUGIN = "plugin"  # the union member of a section whose kind is an import path (or registered later)


def _section_of(registry: Registry, default: str) -> Any:
    """The config type of a registry's entries: the union of their sections, told apart by `kind`; a section
    without `kind` (e.g. from an override `algorithm.policy_loss.clip_high=0.28`) is the `default` entry's.

    A kind not in the registry's table when this module loaded (an import path "pkg.module:ESTIMATOR", or a
    name registered afterwards) is validated against that entry's own `config` class, which the entry is
    loaded (imported) for: a plug-in gets its own typed section, checked like the built-in ones."""
    names = registry.names()

    def kind_of(value: Any) -> str:
        kind = value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)
        return kind if kind in names else PLUGIN

    def plugin_section(value: Any) -> ComponentConfig:
        kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
        config = getattr(registry.get(kind), "config", None)
        if not (isinstance(config, type) and issubclass(config, ComponentConfig)):
            raise ValueError(
                f"{registry.field} {kind!r} has no `config` section class (a subclass of "
                "yatt.algorithms.base.ComponentConfig); see yatt.algorithms.base"
            )
        return value if isinstance(value, config) else config.model_validate(value)

    sections = tuple(Annotated[registry.get(name).config, Tag(name)] for name in names)
    plugin = Annotated[SerializeAsAny[ComponentConfig], PlainValidator(plugin_section), Tag(PLUGIN)]
    union = Annotated[Union[sections + (plugin,)], Discriminator(kind_of)]  # noqa: UP007 (a tuple of types)
    return Annotated[union, BeforeValidator(_bare_name)]


def _bare_name(value: Any) -> Any:
    """A bare name (`algorithm.advantage=rloo`) is the section with that kind and its defaults."""
    return {"kind": value} if isinstance(value, str) else value


def _check_kind(registry: Registry, section: Any) -> None:
    """An unknown kind names the registered ones (pydantic's own message would only say 'invalid')."""
    section = _bare_name(section)
    if isinstance(section, dict) and "kind" in section:
        registry.check(section["kind"])


class AlgorithmConfig(Section):
    advantage: _section_of(ADVANTAGES, "grpo") = Field(  # type: ignore[valid-type]
        default_factory=GRPOConfig,
        description="Advantage estimator: {kind: <registered name>, its fields}; "
        "kind may be an import path 'pkg.module:ESTIMATOR' (an AdvantageEstimator, yatt.algorithms.base).",
    )
    policy_loss: _section_of(POLICY_LOSSES, "ppo_clip") = Field(  # type: ignore[valid-type]
        default_factory=PPOClipConfig,
        description="Policy loss: {kind: <registered name>, its fields}; kind may be "
        "an import path 'pkg.module:LOSS' (a PolicyLoss, yatt.algorithms.base).",
    )
    loss_agg: str = Field(
        "token-mean",
        description=f"How token losses become one: {', '.join(LOSS_AGGREGATIONS)}, "
        "or an import path 'pkg.module:function' (see yatt.algorithms.aggregation).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="0 disables KL and the reference model.")
    kl_estimator: str = Field(
        "k3",
        description=f"KL estimator: {', '.join(KL_ESTIMATORS)} (k1+/k3+: the value "
        "of k1/k3 with the gradient of k2), or an import path 'pkg.module:function' taking "
        "(logprobs, ref_logprobs).",
    )
    kl_mode: Literal["loss", "reward"] = Field(
        "loss", description="KL as a loss term or as a reward penalty (reinforce_pp*: per-token reward shaping)."
    )
    kl_control: KLControlConfig = Field(
        default_factory=KLControlConfig, description="Fixed or adaptive KL coefficient (adaptive starts at kl_coef)."
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        description="Entropy bonus: the loss subtracts entropy_coef x the "
        "policy's per-token entropy (aggregated like the policy loss); 0 disables it.",
    )
    rollout_is: RolloutISConfig = Field(
        default_factory=RolloutISConfig,
        description="Importance-sampling correction of the rollout engine / trainer mismatch.",
    )
    ppo_epochs: int = Field(1, gt=0, description="Passes over each step's rollouts.")
    mini_batches: int = Field(1, gt=0, description="Optimizer steps per pass.")
    old_logprobs: Literal["recompute", "reuse", "rollout"] = Field(
        "reuse",
        description="Where the old policy's log-probs come from. recompute: a trainer pass over every "
        "sample before the update. reuse: the first mini-batch is exactly on-policy, so its own forward gives "
        "them (same values, one pass fewer over its samples); the pass covers the other mini-batches. rollout: "
        "the engine's log-probs (no pass; off-policy by the engine/trainer mismatch).",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    routing_replay: Literal["off", "r2", "r3"] = Field(
        "off",
        description="A mixture-of-experts policy's routing in the trainer's forwards (yatt.models.routing). off: "
        "the trainer's router chooses. r2: the update replays the experts of the trainer's own old-log-prob pass "
        "(the ratio compares one network with itself). r3: both trainer passes replay the experts the rollout "
        "engine routed each prompt and response token to (returned with its log-probs; the hf engine). Replay "
        "forces the experts and recomputes their gate weights from the router's logits. A dense policy ignores it.",
    )
    routing_mismatch: bool = Field(
        False,
        description="Measure a mixture-of-experts policy's routing mismatch under any routing_replay: the engine "
        "returns the experts of every token (as r3 does; the hf engine) and the trainer's first pass over each "
        "sample counts the response tokens predicted at a position whose router's own top-k, before any "
        "replay, differs from the engine's (moe/routing_mismatch). r3 measures it always. Costs the routing "
        "riding with every sample (layers x k ints per token).",
    )

    @property
    def engine_routing(self) -> bool:
        """The engine returns the experts of every token: replayed (r3) or measured (routing_mismatch)."""
        return self.routing_replay == "r3" or self.routing_mismatch

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _bare_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` (file or command line) as false

    @model_validator(mode="before")
    @classmethod
    def _registered_kinds(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_kind(ADVANTAGES, data.get("advantage"))
            _check_kind(POLICY_LOSSES, data.get("policy_loss"))
        return data

    @field_validator("loss_agg")
    @classmethod
    def _known_agg(cls, value: str) -> str:
        return LOSS_AGGREGATIONS.check(value)

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, value: str) -> str:
        return KL_ESTIMATORS.check(value)
