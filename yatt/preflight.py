"""The checks a config cannot make alone, run by the launcher before anything starts (`check_run`).

They need the number of ranks launched or read the files the config names (model folders, tokenizers, data
files, the run directory), which validation never does (yatt.config). Each backend adds its own through its
registry entry's `preflight` (yatt.backends). Every failure is a ConfigError naming the field.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

from yatt.config import ExperimentConfig
from yatt.config_loading import ConfigError
from yatt.genrm.template import template_fields
from yatt.refusals import launch_refusals


def check_cores(cfg: ExperimentConfig, source: str) -> None:
    """Cores a process is pinned to must be ones this machine lets the run use."""
    usable = os.sched_getaffinity(0)
    pinned = {
        "run.cores": cfg.run.cores,
        "rollout.engine.cores": cfg.rollout.engine.cores,
        **{f"reward.judges[{j.name}].engine.cores": j.engine.cores for j in cfg.reward.judges},
        **({"reward.teacher.engine.cores": cfg.reward.teacher.engine.cores} if cfg.reward.teacher else {}),
    }
    for field, cores in pinned.items():
        if cores and not set(cores) <= usable:
            raise ConfigError(f"{source}: {field}={cores}: this machine lets the run use cores {sorted(usable)}")


def check_gpus(cfg: ExperimentConfig, source: str, count: int | None = None) -> None:
    """On a GPU machine (`count` GPUs; None: this one's, 0 on CPU): engines' `gpus` must exist, and a
    schedule ahead of the trainer needs rollout.engine.gpus, the GPUs its rollout engines run on: on the rank's
    own GPU the trainer and the engine generating while it trains would contend for it, and the engine's memory
    share (vllm.gpu_memory_utilization) assumes they take turns."""
    count = _gpus() if count is None else count
    if not count:
        return
    engines = {
        "rollout.engine.gpus": cfg.rollout.engine.gpus,
        **{f"reward.judges[{j.name}].engine.gpus": j.engine.gpus for j in cfg.reward.judges},
        **({"reward.teacher.engine.gpus": cfg.reward.teacher.engine.gpus} if cfg.reward.teacher else {}),
    }
    for field, gpus in engines.items():
        if gpus and max(gpus) >= count:
            raise ConfigError(f"{source}: {field}={gpus}: this machine shows the run {count} GPU(s)")
    mode = cfg.rollout.schedule.mode
    if mode != "sync" and not cfg.rollout.engine.gpus:
        raise ConfigError(
            f"{source}: rollout.schedule.mode={mode} on GPUs needs rollout.engine.gpus: GPUs for the rollout "
            "engines apart from the trainer ranks' (e.g. [4, 5, 6, 7] with 4 ranks on 8 GPUs)"
        )


# The model folders yatt's own configs name, and the command that builds each (by folder name).
BUILT_BY = {
    "quickstart-policy": "make quickstart",
    "quickstart-judge": "make quickstart-genrm",
    "quickstart-judge-base": "make quickstart-genrm",
    "quickstart-vl": "make quickstart-vl",
    "quickstart-vl-judge": "make quickstart-vl-genrm",
    "quickstart-tools-policy": "make quickstart-tools",
    "quickstart-teacher": "make quickstart-distill",
    "smollm2-135m-instruct": "python -m yatt.models.gguf --out models/smollm2-135m-instruct",
}


def check_run(cfg: ExperimentConfig, world_size: int, source: str) -> None:
    """What the config alone cannot tell: rules on the number of ranks launched, and the files it names
    (read here, where the run starts, never during validation). Raises ConfigError naming the field."""
    check_backends(cfg, world_size, source)
    check_gpus(cfg, source)
    check_cores(cfg, source)
    folders = {
        "model.path": cfg.model.path,
        **{f"reward.judges[{j.name}].model": j.model for j in cfg.reward.judges},
        **({"reward.teacher.model": cfg.reward.teacher.model} if cfg.reward.teacher else {}),
        **({"critic.model": cfg.critic.model} if cfg.uses_critic and cfg.critic.model else {}),
    }
    for field, folder in folders.items():
        if not folder.is_dir():
            builder = BUILT_BY.get(folder.name)
            hint = f" (`{builder}` builds it)" if builder else " (a Hugging Face model folder on this machine)"
            raise ConfigError(f"{source}: {field}: model folder not found: {folder}{hint}")
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{source}: {field}: {folder} is not a Hugging Face model folder: config.json is missing")
    for j in cfg.reward.judges:
        vision = "vision_config" in json.loads((j.model / "config.json").read_text())  # models.vision imports torch
        if "images" in template_fields(j.template) and not vision:
            raise ConfigError(
                f"{source}: reward.judges[{j.name}].template: {{images}} needs a vision-language judge, but "
                f"{j.model} is a text-only model (a text judge reads an image prompt's text: drop {{images}})"
            )
    if (
        "critic.model" in folders
        and (vocab := model_vocab(cfg.critic.model)) is not None
        and (tokens := tokenizer_size(cfg.model.path)) is not None
        and vocab < tokens
    ):
        raise ConfigError(
            f"{source}: critic.model: its vocab_size ({vocab}) is smaller than the policy's tokenizer "
            f"({tokens} tokens): the critic reads the policy's token ids"
        )
    for split in ("train", "eval"):
        data = getattr(cfg.data, split)
        missing = [str(f) for f in getattr(data, "files", []) if not f.is_file()]
        if missing:
            raise ConfigError(f"{source}: data.{split}.files: not found: {', '.join(missing)}")
        if getattr(data, "nltk_data", None) is not None and not data.nltk_data.is_dir():
            raise ConfigError(
                f"{source}: data.{split}.nltk_data: {data.nltk_data} is not a folder (build it with "
                f"python -m yatt.envs.nltk_data --out {data.nltk_data})"
            )
    for field, folder in folders.items():
        vocab, tokens = model_vocab(folder), tokenizer_size(folder)
        if vocab is not None and tokens is not None and vocab < tokens:
            raise ConfigError(
                f"{source}: {field}: the model's vocab_size ({vocab}, {folder}/config.json) is smaller "
                f"than its tokenizer's {tokens} tokens: token ids past {vocab - 1} cannot be embedded"
            )
    for field, folder in {
        "run.output_dir": cfg.run.run_dir,
        **({"checkpoint.dir": cfg.checkpoint.dir} if cfg.checkpoint.dir else {}),
    }.items():
        if problem := unwritable(Path(folder)):
            raise ConfigError(f"{source}: {field}: cannot write to {folder}: {problem}")
    missing = [
        (setting, package, extra)
        for setting, package, extra, wanted in (
            ("run.tensorboard=true", "tensorboard", "watch", cfg.run.tensorboard is True),
            ("run.wandb.enabled=true", "wandb", "wandb", cfg.run.wandb.enabled),
            (
                "a parquet data source",
                "pyarrow",
                "data",
                "parquet" in (getattr(cfg.data.train, "kind", ""), getattr(cfg.data.eval, "kind", "")),
            ),
            (
                "a verifiers data source",
                "verifiers",
                "verifiers",
                "verifiers" in (getattr(cfg.data.train, "kind", ""), getattr(cfg.data.eval, "kind", "")),
            ),
        )
        if wanted and importlib.util.find_spec(package) is None
    ]
    for setting, package, extra in missing:
        raise ConfigError(f"{source}: {setting} needs the {package} package: pip install 'yatt[{extra}]'")
    if why := launch_refusals(cfg, world_size):  # the combinations refused with the ranks or model folders known
        raise ConfigError(f"{source}: {why}")
    positions = model_positions(cfg.model.path)
    if positions and cfg.rollout_tokens > positions:
        what = (
            "rollout.agent.max_trajectory_tokens"
            if cfg.rollout.multi_turn
            else "data.max_prompt_tokens + rollout.max_new_tokens"
        )
        raise ConfigError(
            f"{source}: {what} = {cfg.rollout_tokens} "
            f"(prompt + response tokens) but the model has {positions} positions; lower one of them"
        )


def check_backends(cfg: ExperimentConfig, world_size: int, source: str) -> None:
    """The backends' own checks (their `preflight` hooks): the trainer's, then each engine's, named by field."""
    checks = [("", getattr(cfg.trainer.backend_entry, "preflight", None), (cfg.trainer, world_size))]
    engines = {
        "rollout.engine": cfg.rollout.engine,
        **{f"reward.judges[{j.name}].engine": j.engine for j in cfg.reward.judges},
        **({"reward.teacher.engine": cfg.reward.teacher.engine} if cfg.reward.teacher else {}),
    }
    checks += [
        (f"{field}: ", getattr(engine.backend_entry, "preflight", None), (engine,)) for field, engine in engines.items()
    ]
    for field, check, args in checks:
        try:
            if check is not None:
                check(*args)
        except ValueError as err:
            raise ConfigError(f"{source}: {field}{err}") from None


def model_vocab(folder: Path) -> int | None:
    """The model's vocab_size: rows of its embedding (None if its config does not say)."""
    return json.loads((folder / "config.json").read_text()).get("vocab_size")


def tokenizer_size(folder: Path) -> int | None:
    """Token ids the folder's tokenizer can produce, added tokens included (None without a tokenizer)."""
    from yatt.models.tokenizer import load_tokenizer

    try:
        return len(load_tokenizer(folder))
    except (OSError, ValueError):
        return None


def unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (made if missing), or None when they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".yatt-write-check-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def model_positions(folder: Path) -> int | None:
    """The model's max_position_embeddings (None if its config does not say)."""
    return json.loads((folder / "config.json").read_text()).get("max_position_embeddings")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
