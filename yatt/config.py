"""The typed experiment config: one pydantic section per component, loaded from YAML + `a.b=c` overrides.

Every section forbids unknown keys, so a typo fails at start-up with the field and file named
(see yatt.config_loading). Which implementation a component uses (trainer.backend,
rollout.engine.backend, algorithm.advantage.kind, algorithm.policy_loss.kind) is checked against its
registry, so the allowed values are whatever is registered, or an import path 'pkg.module:attr' to a plug-in
(imported when checked; see docs/extending.md). A trainer or engine backend's own settings sit in its own
section beside `backend` (`trainer.megatron`, `rollout.engine.vllm`: yatt.backends). Validation reads only the
config itself and the plug-ins it names (reward.verifiers are imported later, when the run reads its data).
Each section is declared in its own package; this module composes them. Refused combinations of settings are
one table, yatt.refusals: validation runs those the config alone decides; yatt.preflight (`check_run`, which
the launcher calls before anything starts, with each backend's own `preflight`) runs those that need the world
size or a model folder, and checks the files the config names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from yatt.agents.config import AgentConfig
from yatt.algorithms import ADVANTAGES
from yatt.algorithms.config import AlgorithmConfig, DynamicSamplingConfig  # noqa: F401  (re-exported)
from yatt.balance.config import BalanceConfig
from yatt.checkpoint.config import CheckpointConfig
from yatt.config_loading import Section, load_config
from yatt.controllers.schedule_config import ScheduleConfig
from yatt.data.config import DataConfig, DataSource, FileSource, GymSource  # noqa: F401  (re-exported)
from yatt.engines.config import EngineConfig
from yatt.genrm.config import RewardConfig
from yatt.models.lora_config import LoRAConfig
from yatt.placement.config import PlacementConfig
from yatt.refusals import config_refusals
from yatt.trainers.config import TrainerConfig
from yatt.trainers.critic_config import CriticConfig


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
    peer_timeout_s: float = Field(
        45.0,
        ge=5,
        description="Across nodes: a node whose ranks sent no heartbeat for this long is lost, and every other "
        "rank ends with one line naming it (node rank and address) within this plus a sixth of it; relaunching "
        "every node resumes from the last checkpoint (docs/multinode.md#losing-a-node). Longer than any pause "
        "of a live rank's Python threads; not used on one node, where torchrun's agent sees a dead rank itself.",
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
        """The combinations yatt refuses that the config alone decides: the table of yatt.refusals."""
        config_refusals(self)
        return self

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
