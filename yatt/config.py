"""The typed experiment config: one pydantic section per component, loaded from YAML + `a.b=c` overrides.

Every section forbids unknown keys, so a typo fails at start-up with the field and file named
(see yatt.config_loading). Cross-section rules that make a config impossible live in
`ExperimentConfig._check_combinations`; rules that need the world size live in `check_world`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from yatt.config_loading import ConfigError, load_config
from yatt.engines.config import EngineConfig
from yatt.genrm.config import JudgeConfig


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Section):
    path: Path = Field(description="Local Hugging Face model folder (config.json, weights, tokenizer).")

    @field_validator("path")
    @classmethod
    def _folder_exists(cls, path: Path) -> Path:
        if not path.is_dir():
            raise ValueError(f"model folder not found: {path} (build the quickstart one with "
                             "`python launch/sft.py --config configs/sft_quickstart.yaml`)")
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model folder: config.json is missing")
        return path


class JsonlSource(Section):
    kind: Literal["jsonl"] = "jsonl"
    files: list[Path] = Field(min_length=1, description="JSONL files; one prompt per line (see yatt.data.jsonl).")

    @field_validator("files")
    @classmethod
    def _files_exist(cls, files: list[Path]) -> list[Path]:
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"data file(s) not found: {', '.join(missing)}")
        return files


class GymSource(Section):
    kind: Literal["reasoning_gym"]
    dataset: str = Field(description="reasoning-gym dataset name, e.g. basic_arithmetic.")
    size: int = Field(10_000, gt=0, description="Number of procedurally generated prompts.")
    seed: int = Field(0, description="Generator seed; use different seeds for the train and eval splits.")
    options: dict = Field(default_factory=dict, description="Extra keyword arguments of the generator.")


DataSource = Annotated[Union[JsonlSource, GymSource], Field(discriminator="kind")]


class DataConfig(Section):
    train: DataSource
    eval: DataSource | None = Field(None, description="Held-out prompts for greedy accuracy.")
    prompts_per_step: int = Field(32, gt=0, description="Prompts per RL step over all ranks.")
    eval_prompts: int = Field(500, gt=0, description="Held-out prompts evaluated (over all ranks).")
    max_prompt_tokens: int = Field(256, gt=0, description="Longer prompts are an error, not truncated.")
    shuffle: bool = Field(True, description="Reshuffle each rank's shard every epoch.")


class RolloutConfig(Section):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    group_size: int = Field(8, gt=0, description="Samples per prompt (G).")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(16, gt=0)
    engines_per_rank: int = Field(1, gt=0, description="Rollout engines per rank; each request goes to the "
                                  "rollout engine in use with the fewest requests in flight.")


class RewardConfig(Section):
    kind: Literal["rule", "genrm", "genrm_with_rule"] = Field(
        "rule", description="rule: the verifier chosen by each row's data_source; genrm: the judges' weighted "
        "mean; genrm_with_rule: the weighted mean of the rule score (rule_weight) and the judges.")
    rule_weight: float = Field(1.0, ge=0.0, description="Weight of the rule score in genrm_with_rule.")
    judges: list[JudgeConfig] = Field(default_factory=list, description="Generative reward models (GenRM).")

    @model_validator(mode="after")
    def _judges_match_kind(self) -> "RewardConfig":
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
    def _ordered(self) -> "DynamicSamplingConfig":
        if not self.min_oversample <= self.initial_oversample <= self.max_oversample:
            raise ValueError("need min_oversample <= initial_oversample <= max_oversample")
        return self


class AlgorithmConfig(Section):
    advantage: Literal["grpo"] = "grpo"
    normalize_std: bool = Field(True, description="Divide group-centred rewards by the group std.")
    policy_loss: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, gt=0.0, lt=1.0)
    clip_high: float = Field(0.2, gt=0.0, description="Set above clip_low for clip-higher (DAPO).")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip bound c for negative advantages.")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0.0, description="0 disables KL and the reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = Field("loss", description="KL as a loss term or as a reward penalty.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each step's rollouts.")
    mini_batches: int = Field(1, gt=0, description="Optimizer steps per pass.")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)


class TrainerConfig(Section):
    backend: Literal["torch"] = "torch"
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning rate after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine: final lr as a fraction of lr.")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward.")
    micro_batch_tokens: int = Field(0, ge=0, description="If > 0, pack micro-batches by padded tokens "
                                    "(sequences x longest length) up to this budget instead of micro_batch_size.")


class BalanceConfig(Section):
    """Moving rollouts between data-parallel ranks so each trains about the same work (DESIGN.md, principle 7)."""

    enabled: bool = Field(False, description="Rebalance rollouts across ranks after rewards, before logprobs.")
    attention_coef: float = Field(0.0, ge=0.0, description="Workload per sample is L + attention_coef * L^2 "
                                  "(L = prompt + response tokens); raise it when attention dominates.")
    partitioner: Literal["kk", "greedy"] = Field("kk", description="kk: Karmarkar-Karp; greedy: LPT.")
    equal_count: bool = Field(False, description="Also give every rank the same number of units (+-1).")
    keep_groups: bool | None = Field(None, description="Move whole GRPO groups; None: when the advantage "
                                     "estimator needs them (grpo does).")


class PlacementConfig(Section):
    mode: Literal["full", "partial"] = Field(
        "full", description="full: every device serves rollout, then GenRM, then training. partial: during "
        "generation some devices serve rollout while the others serve GenRM at the same time; then all train.")
    rollout_devices: int | None = Field(None, gt=0, description="partial: rollout devices at the start "
                                        "(None: half of them, rounded up).")
    min_rollout_devices: int = Field(1, gt=0, description="partial: lower bound of the rollout split.")
    min_genrm_devices: int = Field(1, gt=0, description="partial: lower bound of the GenRM split.")
    dynamic: bool = Field(True, description="partial: re-choose the split between steps from measured load.")
    load_smoothing: float = Field(0.5, ge=0.0, lt=1.0, description="partial: EMA factor of the measured load.")


class CheckpointConfig(Section):
    """Asynchronous, crash-consistent checkpoints (yatt.checkpoint); SIGTERM/SIGUSR1 always save."""

    every: int = Field(0, ge=0, description="Save every N steps, right after the weight sync (0: off; "
                                            "preemption signals still save).")
    keep: int = Field(3, gt=0, description="Keep the newest K complete checkpoints; older ones are deleted.")
    async_write: bool = Field(True, description="Write in a background thread; training only waits for the "
                                                "host-memory snapshot. false: block until the files are on disk.")
    export_hf: bool = Field(False, description="Also write the policy as a Hugging Face folder (policy/) "
                                               "inside each checkpoint.")
    dir: Path | None = Field(None, description="Where checkpoints go; default run_dir/checkpoints.")
    debug_write_delay_s: float = Field(0.0, ge=0.0, description="Test-only fault injection: sleep this long "
                                                               "after each file written, to widen the crash window.")


class RunConfig(Section):
    name: str = "run"
    output_dir: Path = Field(Path("runs"), description="The run directory is output_dir/name.")
    steps: int = Field(40, gt=0)
    eval_every: int = Field(10, ge=0, description="Held-out eval every N steps (0: start and end only).")
    seed: int = 0
    threads: int = Field(1, gt=0, description="Compute threads per process (1 on small CPU boxes).")
    export_policy: bool = Field(True, description="Write the final policy as an HF folder in the run dir.")

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
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> "ExperimentConfig":
        if self.placement.mode == "partial" and not self.reward.judges:
            raise ValueError("placement.mode=partial splits devices between rollout and a generative reward "
                             "model, but reward.judges is empty; use placement.mode=full or add a judge")
        if self.algorithm.advantage == "grpo" and self.rollout.group_size < 2:
            raise ValueError("rollout.group_size must be >= 2 for GRPO (advantages are relative to the group)")
        if self.algorithm.advantage == "grpo" and self.balance.keep_groups is False:
            raise ValueError("balance.keep_groups=false would split GRPO groups across ranks, but GRPO "
                             "advantages need whole groups on one rank")
        if self.data.prompts_per_step % self.algorithm.mini_batches:
            raise ValueError(f"data.prompts_per_step={self.data.prompts_per_step} is not divisible by "
                             f"algorithm.mini_batches={self.algorithm.mini_batches}")
        need = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if self.rollout.engine.max_model_len is None:
            self.rollout.engine.max_model_len = need
        elif need > self.rollout.engine.max_model_len:
            raise ValueError(f"data.max_prompt_tokens + rollout.max_new_tokens = {need} exceeds "
                             f"rollout.engine.max_model_len={self.rollout.engine.max_model_len}")
        positions = json.loads((self.model.path / "config.json").read_text()).get("max_position_embeddings")
        if positions and self.rollout.engine.max_model_len > positions:
            raise ValueError(f"rollout.engine.max_model_len={self.rollout.engine.max_model_len} (prompt + response "
                             f"tokens) but the model has {positions} positions; lower data.max_prompt_tokens or "
                             "rollout.max_new_tokens")
        return self


def check_world(cfg: ExperimentConfig, world_size: int, source: str) -> None:
    """Rules that depend on how many ranks were launched."""
    p = cfg.placement
    if p.mode == "partial" and world_size < p.min_rollout_devices + p.min_genrm_devices:
        raise ConfigError(f"{source}: placement.mode=partial needs at least "
                          f"{p.min_rollout_devices + p.min_genrm_devices} devices (min_rollout_devices + "
                          f"min_genrm_devices), but {world_size} were launched")
    per_rank, rest = divmod(cfg.data.prompts_per_step, world_size)
    if rest or per_rank % cfg.algorithm.mini_batches:
        raise ConfigError(f"{source}: data.prompts_per_step={cfg.data.prompts_per_step} must split evenly over "
                          f"{world_size} ranks and then into algorithm.mini_batches={cfg.algorithm.mini_batches}")


def load_experiment(path: str | Path, overrides: list[str] = (), placement: str | None = None) -> ExperimentConfig:
    """The experiment config of `path`; `placement` is the --placement shortcut for placement.mode."""
    overrides = list(overrides) + ([f"placement.mode={placement}"] if placement else [])
    return load_config(ExperimentConfig, path, overrides)
