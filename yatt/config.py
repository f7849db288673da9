"""The typed experiment config: one pydantic section per component, loaded from YAML + `a.b=c` overrides.

Every section forbids unknown keys, so a typo fails at start-up with the field and file named
(see yatt.config_loading). Which implementation a component uses (trainer.backend,
rollout.engine.backend, algorithm.advantage.kind, algorithm.policy_loss.kind) is checked against its
registry, so the allowed values are whatever is registered, or an import path 'pkg.module:attr' to a plug-in
(imported when checked; see docs/extending.md). A trainer or engine backend's own settings sit in its own
section beside `backend` (`trainer.megatron`, `rollout.engine.vllm`: yatt.backends). Validation reads only the
config itself and the plug-ins it names (reward.verifiers are imported later, when the run reads its data):
cross-section rules live in `ExperimentConfig._check_combinations`; rules that need the world size or the files
the config names (model folders, data files) live in yatt.preflight (`check_run`), which the launcher calls before
anything starts, with each backend's own `preflight`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    SerializeAsAny,
    Tag,
    field_validator,
    model_validator,
)

from yatt.agents.config import AgentConfig
from yatt.algorithms import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from yatt.algorithms.base import ComponentConfig
from yatt.algorithms.grpo import GRPOConfig
from yatt.algorithms.kl_control import KLControlConfig
from yatt.algorithms.ppo_clip import PPOClipConfig
from yatt.algorithms.rollout_is import RolloutISConfig
from yatt.backends import BackendChoice
from yatt.balance.partition import PARTITIONERS
from yatt.config_loading import load_config
from yatt.data.config import DataSource, FileSource, GymSource  # noqa: F401  (re-exported: part of the config)
from yatt.engines.config import EngineConfig
from yatt.genrm.config import JudgeConfig
from yatt.genrm.mixing import MixMode
from yatt.models.lora_config import LoRAConfig
from yatt.registry import Registry, is_import_path
from yatt.trainers import TRAINERS
from yatt.trainers.critic_config import CriticConfig


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Section):
    path: Path = Field(description="Local Hugging Face model folder (config.json, weights, tokenizer).")
    freeze_vision: bool = Field(
        False,
        description="Vision-language policy: keep the vision tower's weights fixed "
        "(no gradients, no optimizer state, not sent to engines); the connector and "
        "the decoder train. No effect on a text policy.",
    )
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig, description="Train LoRA adapters instead of every weight (rank > 0; docs/lora.md)."
    )


class DataConfig(Section):
    train: DataSource
    eval: DataSource | None = Field(None, description="Held-out prompts for greedy accuracy.")
    prompts_per_step: int = Field(32, gt=0, description="Prompts per RL step over all ranks.")
    eval_prompts: int = Field(500, gt=0, description="Held-out prompts evaluated (over all ranks).")
    max_prompt_tokens: int = Field(256, gt=0, description="Longer prompts are an error, not truncated.")
    shuffle: bool = Field(True, description="Reshuffle each rank's shard every epoch.")
    check_images: bool = Field(
        True,
        description="Before any engine starts, read and decode each image of this "
        "rank's rows once (then drop it), so a missing or corrupt image stops the run naming "
        "the file and row; false: found when the step that uses it reads it.",
    )


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


class RolloutConfig(Section):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    group_size: int = Field(8, gt=0, description="Samples per prompt (G).")
    temperature: float = Field(
        1.0,
        ge=0.0,
        description="Sampling temperature; trainer and engine log-probs are both of softmax(logits / temperature).",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling; < 1 makes the engine's log-probs "
        "differ from the trainer's, which does not renormalise over the nucleus "
        "(docs/algorithms.md, 'Temperature and top-p').",
    )
    sync_every: int = Field(
        1,
        gt=0,
        description="Push the policy to the rollout engines every N steps; > 1 "
        "makes rollouts deliberately stale (off-policy experiments, rollout IS correction).",
    )
    max_new_tokens: int = Field(16, gt=0)
    engines_per_rank: int = Field(
        1,
        gt=0,
        description="Rollout engines per rank; each request goes to the "
        "rollout engine in use with the fewest requests in flight.",
    )
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    agent: AgentConfig = Field(
        default_factory=AgentConfig,
        description="How a sample's conversation unfolds (yatt.agents, docs/agents.md): single_turn, one "
        "generate call (the default), or a loop of model turns and tool calls.",
    )

    @property
    def multi_turn(self) -> bool:
        """Whether samples are conversations driven by an agent loop (anything but single_turn)."""
        return self.agent.kind != "single_turn"


class RewardConfig(Section):
    kind: MixMode = Field(
        "rule",
        description="rule: the verifier chosen by each row's data_source; genrm: the judges' weighted "
        "mean; genrm_with_rule: the weighted mean of the rule score (rule_weight) and the judges.",
    )
    rule_weight: float = Field(1.0, ge=0.0, description="Weight of the rule score in genrm_with_rule.")
    judges: list[JudgeConfig] = Field(default_factory=list, description="Generative reward models (GenRM).")
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


class TrainerConfig(BackendChoice):
    """The training backend and the settings every backend reads; beside `backend` sits that backend's own
    section, e.g. ``torch: {activation_checkpointing: true}`` (`yatt.trainers.torch_config`) or
    ``megatron: {tensor_parallel: 2}`` (`yatt.trainers.megatron_config`), an error when set for a backend that is
    not selected."""

    backends = TRAINERS

    backend: str = Field(
        "torch",
        description="Training backend, a name in yatt.trainers.TRAINERS (torch; megatron, "
        "its section: megatron) or an import path 'package.module:Class'.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights, gradients and optimizer state; log-probs and losses are float32 either way."
    )
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning rate after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine: final lr as a fraction of lr.")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward.")
    micro_batch_tokens: int = Field(
        2048,
        ge=0,
        description="If > 0, a micro-batch also holds at most this many "
        "tokens (real tokens when pack_sequences, else sequences x longest length): "
        "bounds activation memory whatever the lengths; raise it on GPUs with memory "
        "to spare. 0: micro_batch_size alone.",
    )
    pack_sequences: bool = Field(
        True,
        description="Lay a micro-batch's sequences end to end (no pad tokens in the "
        "linear layers; attention kept per sequence). False: right-padded rows.",
    )
    share_prompts: bool = Field(
        True,
        description="pack_sequences: consecutive samples of the same prompt (a GRPO "
        "group) run it through the model once per micro-batch, their responses attending "
        "to that one copy (exact; yatt.trainers.packing).",
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        return TRAINERS.check(name)

    @property
    def model_parallel(self) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes the backend splits the model into: ranks per data-parallel rank.
        The backend's section answers (`model_parallel`); a backend without one holds the whole model per rank."""
        return getattr(self.backend_config, "model_parallel", (1, 1))


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


class CheckpointConfig(Section):
    """Asynchronous, crash-consistent checkpoints (yatt.checkpoint); SIGTERM/SIGUSR1 always save."""

    every: int = Field(
        0, ge=0, description="Save every N steps, right after the weight sync (0: off; preemption signals still save)."
    )
    keep: int = Field(3, gt=0, description="Keep the newest K complete checkpoints; older ones are deleted.")
    async_write: bool = Field(
        True,
        description="Write in a background thread; training only waits for the "
        "host-memory snapshot. false: block until the files are on disk.",
    )
    export_hf: bool = Field(
        False, description="Also write the policy as a Hugging Face folder (policy/) inside each checkpoint."
    )
    dir: Path | None = Field(None, description="Where checkpoints go; default run_dir/checkpoints.")
    debug_write_delay_s: float = Field(
        0.0,
        ge=0.0,
        description="Test-only fault injection: sleep this long after each file written, to widen the crash window.",
        json_schema_extra={"hidden": True},  # kept out of docs/config.md
    )


class WandbConfig(Section):
    """Weights & Biases logging (needs `pip install 'yatt[wandb]'`); rank 0 logs every step's metrics."""

    enabled: bool = Field(False, description="Log to wandb as well as metrics.jsonl.")
    project: str = Field("yatt", description="wandb project.")
    entity: str | None = Field(None, description="wandb entity (team or user); null: your default.")
    name: str | None = Field(None, description="Run name in wandb; null: run.name.")
    mode: Literal["online", "offline"] = Field(
        "offline",
        description="offline: write under the run directory and upload later with `wandb sync` (no network needed).",
    )


class RunConfig(Section):
    name: str = "run"
    output_dir: Path = Field(Path("runs"), description="The run directory is output_dir/name.")
    steps: int = Field(40, gt=0)
    eval_every: int = Field(10, ge=0, description="Held-out eval every N steps (0: start and end only).")
    seed: int = 0
    threads: int = Field(1, gt=0, description="Compute threads per process (1 on small CPU boxes).")
    cores: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="CPU cores the rank processes (controller and trainer) are pinned to (sched_setaffinity), "
        "e.g. apart from the engines' (rollout.engine.cores) so that rollouts ahead of the trainer overlap with "
        "it (docs/async.md); null: the OS schedules them.",
    )
    gc: Literal["step", "auto"] = Field(
        "step",
        description="Python's garbage collector during training. step: its automatic collections are off and "
        "every rank collects once at the start of each step, over what the run made since set-up (that is "
        "frozen, gc.freeze), so the ranks pause together; a collection at a random point stalls the other ranks "
        "at their next collective, ~70 a step with tensor parallelism. auto: Python's own thresholds.",
    )
    export_policy: bool = Field(True, description="Write the final policy as an HF folder in the run dir.")
    tensorboard: bool | None = Field(
        None,
        description="TensorBoard event files in run_dir/tensorboard; null: "
        "when the tensorboard package is installed, true: required.",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    samples: int = Field(
        8,
        ge=0,
        description="At each eval, write this many held-out responses and this many of "
        "the step's training rollouts (rewards, judge scores) to samples.jsonl; 0: none.",
    )

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.name


class ExperimentConfig(Section):
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="PPO's value model (on with algorithm.advantage.kind: gae)."
    )
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> ExperimentConfig:
        self._check_lora()
        if self.rollout.schedule.mode != "sync":
            mode = self.rollout.schedule.mode
            if self.rollout.sync_every != 1:
                raise ValueError(
                    f"rollout.schedule.mode={mode} decides which weights each batch is generated with; "
                    "rollout.sync_every must be 1"
                )
        elif self.rollout.schedule.in_flight == "resume":
            raise ValueError(
                "rollout.schedule.in_flight=resume: the sync schedule never pushes while requests are in flight; "
                "use mode=one_step_off or async"
            )
        if self.placement.mode == "partial" and not self.reward.judges:
            raise ValueError(
                "placement.mode=partial splits devices between rollout and a generative reward "
                "model, but reward.judges is empty; use placement.mode=full or add a judge"
            )
        advantage = self.algorithm.advantage.kind
        if ADVANTAGES.get(advantage).needs_groups:
            if self.rollout.group_size < 2:
                raise ValueError(
                    f"rollout.group_size must be >= 2 for {advantage} (advantages are relative to the group)"
                )
            if self.balance.keep_groups is False:
                raise ValueError(
                    f"balance.keep_groups=false would split groups across ranks, but {advantage} "
                    "advantages need whole groups on one rank"
                )
        if ADVANTAGES.get(advantage).needs_greedy_baseline and self.reward.kind != "rule":
            raise ValueError(
                f"{advantage} scores its greedy baseline responses with the rule verifier; it needs "
                f"reward.kind=rule, not {self.reward.kind}"
            )
        if ADVANTAGES.get(advantage).needs_values and self.critic.enabled is False:
            raise ValueError(
                f"algorithm.advantage.kind={advantage} reads a critic's values, but critic.enabled "
                "is false; set it to true or null"
            )
        if self.uses_critic and self.critic.warmup_steps >= self.run.steps:
            raise ValueError(
                f"critic.warmup_steps={self.critic.warmup_steps} would leave no step of run.steps="
                f"{self.run.steps} in which the policy trains"
            )
        if self.data.prompts_per_step % self.algorithm.mini_batches:
            raise ValueError(
                f"data.prompts_per_step={self.data.prompts_per_step} is not divisible by "
                f"algorithm.mini_batches={self.algorithm.mini_batches}"
            )
        every = self.rollout.sync_every
        if every > 1 and self.checkpoint.every % every:
            raise ValueError(
                f"checkpoint.every={self.checkpoint.every} must be a multiple of "
                f"rollout.sync_every={every}: a resumed run pushes the checkpointed policy to the "
                "engines, which is only what they held at a sync step"
            )
        limit = self.rollout.engine.max_model_len
        if limit is not None and self.rollout_tokens > limit:
            what = (
                "rollout.agent.max_trajectory_tokens"
                if self.rollout.multi_turn
                else "data.max_prompt_tokens + rollout.max_new_tokens"
            )
            raise ValueError(f"{what} = {self.rollout_tokens} exceeds rollout.engine.max_model_len={limit}")
        if self.rollout.multi_turn:
            self._check_agent()
        return self

    def _check_lora(self) -> None:
        """model.lora against the trainer and engine backends: each declares what it can (yatt.backends)."""
        lora = self.model.lora
        if not lora.enabled:
            return
        trainer = getattr(self.trainer.backend_entry, "lora", False)
        if trainer is not True:
            why = trainer or "it does not declare lora = True (yatt.backends)"
            raise ValueError(
                f"model.lora.rank={lora.rank}: trainer.backend={self.trainer.backend} does not train LoRA adapters "
                f"yet: {why}; use trainer.backend=torch or model.lora.rank=0"
            )
        engine = self.rollout.engine
        if lora.sync == "adapter" and not getattr(engine.backend_entry, "adapters", False):
            raise ValueError(
                f"model.lora.sync=adapter: rollout.engine.backend={engine.backend} does not take LoRA adapters (it "
                "does not declare adapters = True, yatt.backends); use model.lora.sync=merged"
            )
        if lora.sync == "adapter" and engine.max_lora_rank is not None and engine.max_lora_rank < lora.rank:
            raise ValueError(
                f"rollout.engine.max_lora_rank={engine.max_lora_rank} is below model.lora.rank={lora.rank}; "
                "raise it or leave it unset (the run sets it to model.lora.rank)"
            )

    def _check_agent(self) -> None:
        """What an agent loop (rollout.agent.kind other than single_turn) does not compose with."""
        kind, cap = self.rollout.agent.kind, self.rollout.agent.max_trajectory_tokens
        if cap <= self.data.max_prompt_tokens:
            raise ValueError(
                f"rollout.agent.max_trajectory_tokens={cap} leaves no room for a response after "
                f"data.max_prompt_tokens={self.data.max_prompt_tokens}"
            )
        if self.rollout.schedule.in_flight == "resume":
            raise ValueError(
                f"rollout.agent.kind={kind} with rollout.schedule.in_flight=resume is not implemented (a "
                "conversation's turns are separate requests whose per-token versions are not kept); use finish"
            )

    @property
    def uses_critic(self) -> bool:
        """Whether the run trains a value model (critic.enabled, null: when the estimator reads values)."""
        enabled = self.critic.enabled
        return ADVANTAGES.get(self.algorithm.advantage.kind).needs_values if enabled is None else enabled

    @property
    def critic_path(self) -> Path:
        """The folder the critic starts from."""
        return self.critic.model or self.model.path

    @property
    def rollout_tokens(self) -> int:
        """The longest prompt + response a rollout engine must hold: a whole trajectory with an agent loop (each
        turn's request is the conversation so far plus at most what the cap leaves)."""
        single = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        return max(single, self.rollout.agent.max_trajectory_tokens) if self.rollout.multi_turn else single


def load_experiment(path: str | Path, overrides: list[str] = (), placement: str | None = None) -> ExperimentConfig:
    """The experiment config of `path`; `placement` is the --placement shortcut for placement.mode."""
    overrides = list(overrides) + ([f"placement.mode={placement}"] if placement else [])
    return load_config(ExperimentConfig, path, overrides)
