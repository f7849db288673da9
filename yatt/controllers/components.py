"""The one factory: what a controller shard runs on, built from the config through the registries.

`trainer.backend` picks the training backend (yatt.trainers.TRAINERS), `rollout.engine.backend` and each
judge's `engine.backend` the inference backend of the engine processes (yatt.engines.ENGINES),
`algorithm.advantage` / `algorithm.policy_loss` the RL math (yatt.algorithms), and `critic` PPO's value model
on the policy's backend (`head="value"`). The shard only sees the interfaces, so tests hand it fakes and a
new backend never touches the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from yatt.algorithms.objective import Algorithm
from yatt.config import ExperimentConfig
from yatt.controllers.critic import Critic
from yatt.distributed import World
from yatt.engines.client import spawn_engine
from yatt.models.tokenizer import load_tokenizer
from yatt.placement.engine_lifecycle import EngineServices, Spawn
from yatt.trainers import TRAINERS
from yatt.trainers.base import Trainer


@dataclass
class Components:
    tokenizer: Any
    trainer: Trainer  # the policy
    ref: Trainer | None  # the frozen reference policy (only with a KL term; with LoRA the policy, adapter off)
    engines: EngineServices  # this rank's engine processes and clients to every rank's engines
    algorithm: Algorithm
    critic: Critic | None = None  # PPO's value model (cfg.uses_critic)


def build_components(cfg: ExperimentConfig, world: World, run_dir: Path, spawn: Spawn = spawn_engine) -> Components:
    torch.manual_seed(cfg.run.seed)
    backend = TRAINERS.get(cfg.trainer.backend)
    per_step = cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches  # optimizer steps per RL step
    # the policy does not step during the critic's warm-up, so its lr schedule spans the steps after it
    policy_steps = cfg.run.steps - (cfg.critic.warmup_steps if cfg.uses_critic else 0)
    lora = {"lora": cfg.model.lora} if cfg.model.lora.enabled else {}  # a backend that declares lora takes it
    trainer = backend(
        cfg.model.path,
        cfg.trainer,
        world,
        total_steps=policy_steps * per_step,
        freeze_vision=cfg.model.freeze_vision,
        **lora,
    )
    ref = None
    if cfg.algorithm.kl_coef:  # for free if the policy can give one (LoRA: its adapter off), else a frozen copy
        ref = trainer.reference() or backend(cfg.model.path, cfg.trainer, world, trainable=False)
    critic = None
    if cfg.uses_critic:  # the trainer section's settings with the critic's own learning rate
        value_model = backend(
            cfg.critic_path,
            cfg.trainer.model_copy(update={"lr": cfg.critic.lr}),
            world,
            total_steps=cfg.run.steps * per_step,
            head="value",
        )
        critic = Critic(
            cfg.critic,
            value_model,
            world,
            cfg.critic.loss_agg or cfg.algorithm.loss_agg,
            norm_length=cfg.rollout.max_new_tokens,
        )
    bucket_bytes = cfg.rollout.engine.weight_bucket_mb << 20  # the engines load the policy in buckets this big
    engines = EngineServices(
        cfg,
        world,
        run_dir,
        spawn,
        policy_weights=lambda: trainer.engine_weights(bucket_bytes),
        policy_versions=trainer.weight_versions,  # the delta sync (rollout.engine.delta_sync)
    )
    return Components(
        tokenizer=load_tokenizer(cfg.model.path),
        trainer=trainer,
        ref=ref,
        engines=engines,
        algorithm=Algorithm(cfg.algorithm),
        critic=critic,
    )
