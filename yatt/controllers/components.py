"""The one factory: what a controller shard runs on, built from the config through the registries.

`trainer.backend` picks the training backend (yatt.trainers.TRAINERS), `rollout.engine.backend` and each
judge's `engine.backend` the inference backend of the engine processes (yatt.engines.ENGINES), and
`algorithm.advantage` / `algorithm.policy_loss` the RL math (yatt.algorithms). The shard only sees the
interfaces, so tests hand it fakes and a new backend never touches the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from yatt.algorithms.objective import Algorithm
from yatt.config import ExperimentConfig
from yatt.distributed import World
from yatt.engines.client import spawn_engine
from yatt.placement.services import EngineServices, Spawn
from yatt.trainers import TRAINERS
from yatt.trainers.base import Trainer


@dataclass
class Components:
    tokenizer: Any
    trainer: Trainer  # the policy
    ref: Trainer | None  # the frozen reference policy (only with a KL term)
    engines: EngineServices  # this rank's engine processes and clients to every rank's engines
    algorithm: Algorithm


def build_components(cfg: ExperimentConfig, world: World, run_dir: Path, spawn: Spawn = spawn_engine) -> Components:
    torch.manual_seed(cfg.run.seed)
    backend = TRAINERS.get(cfg.trainer.backend)
    optimizer_steps = cfg.run.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
    trainer = backend(cfg.model.path, cfg.trainer, world, total_steps=optimizer_steps,
                      freeze_vision=cfg.model.freeze_vision)
    ref = backend(cfg.model.path, cfg.trainer, world, trainable=False) if cfg.algorithm.kl_coef else None
    return Components(tokenizer=AutoTokenizer.from_pretrained(str(cfg.model.path)), trainer=trainer, ref=ref,
                      engines=EngineServices(cfg, world, run_dir, spawn), algorithm=Algorithm(cfg.algorithm))
