"""The config fields a checkpoint must agree on to be resumed.

Resuming continues the same run: what determines the model's shape, the data order, the samples
drawn and the update must be equal. Everything else may differ, e.g. run.steps (extend a run),
eval settings, run.name/output_dir, threads, checkpoint settings, trainer.micro_batch_size/_tokens
(change only the summation order), balance, placement and engine tuning, and the number of ranks (the
checkpoint re-cuts what the ranks hold: yatt.checkpoint.resume.load_resharded, yatt.data.stream).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from yatt.config import ExperimentConfig


def config_fingerprint(cfg: ExperimentConfig) -> dict[str, Any]:
    arch = (cfg.model.path / "config.json").read_bytes()
    fields = {
        "model": {
            "path": str(cfg.model.path),
            "config_json_blake2b": hashlib.blake2b(arch).hexdigest()[:32],
            # only with LoRA, so checkpoints of runs without it stay resumable across this field's arrival
            **({"lora": cfg.model.lora.model_dump(mode="json", exclude={"sync"})} if cfg.model.lora.enabled else {}),
        },
        "data": cfg.data.model_dump(mode="json", include={"train", "prompts_per_step", "max_prompt_tokens", "shuffle"}),
        "rollout": cfg.rollout.model_dump(
            mode="json", include={"group_size", "temperature", "top_p", "max_new_tokens"}
        ),
        # the teacher only when there is one, so checkpoints of runs without it stay resumable across its arrival
        "reward": cfg.reward.model_dump(
            mode="json",
            exclude={"judges": {"__all__": {"engine"}}, "teacher": {"engine"} if cfg.reward.teacher else True},
        ),
        "algorithm": cfg.algorithm.model_dump(mode="json"),
        "trainer": cfg.trainer.model_dump(mode="json", exclude={"micro_batch_size", "micro_batch_tokens"}),
        # only with a critic, so checkpoints of critic-free runs stay resumable across this field's arrival
        **({"critic": cfg.critic.model_dump(mode="json", exclude={"enabled"})} if cfg.uses_critic else {}),
        "run": {"seed": cfg.run.seed},
    }
    return json.loads(json.dumps(fields))  # tuples -> lists, as they come back from the manifest
