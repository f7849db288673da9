"""Every combination of settings yatt refuses, declared once (`REFUSALS`), with why.

A refusal names the fields it is about and a check that returns the one-line reason (or None). Those that the
config alone decides run at validation (`ExperimentConfig` calls `config_refusals`); those that need the number
of ranks launched or a model folder's config.json (read as JSON: no model, no torch) run in `yatt.preflight`
before any rank starts (`launch_refusals`). scripts/config_docs.py lists the table in docs/config.md. Checks of
one field alone (a range, a name in a registry) stay on the field; files that must exist stay in
yatt.preflight.

Lower layers may refuse again where they are used (a trainer given LoRA on a value model): that is their own
contract, not a second place for the rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yatt.algorithms import ADVANTAGES

Check = Callable[..., str | None]  # config: (cfg); launch: (cfg, world_size)


@dataclass(frozen=True)
class Refusal:
    fields: str  # the settings involved, as docs/config.md lists them
    why: str  # one sentence for the docs
    check: Check
    launch: bool = False  # needs the ranks launched or a model folder: checked by yatt.preflight


def _model_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _vision(folder: Path) -> bool:
    return "vision_config" in _model_config(folder)


def _estimator(cfg: Any) -> Any:
    return ADVANTAGES.get(cfg.algorithm.advantage.kind)


def _ahead_sync_every(cfg: Any) -> str | None:
    mode = cfg.rollout.schedule.mode
    if mode != "sync" and cfg.rollout.sync_every != 1:
        return (
            f"rollout.schedule.mode={mode} decides which weights each batch is generated with; "
            "rollout.sync_every must be 1"
        )
    return None


def _resume_in_sync(cfg: Any) -> str | None:
    if cfg.rollout.schedule.mode == "sync" and cfg.rollout.schedule.in_flight == "resume":
        return (
            "rollout.schedule.in_flight=resume: the sync schedule never pushes while requests are in flight; "
            "use mode=one_step_off or async"
        )
    return None


def _partial_without_judge(cfg: Any) -> str | None:
    if cfg.placement.mode == "partial" and not cfg.reward.judges and cfg.reward.teacher is None:
        return (
            "placement.mode=partial splits devices between rollout and a generative reward "
            "model, but reward.judges is empty (and there is no reward.teacher); use placement.mode=full or add "
            "a judge"
        )
    return None


def _teacher_unread(cfg: Any) -> str | None:
    advantage, teacher = cfg.algorithm.advantage.kind, cfg.reward.teacher is not None
    if _estimator(cfg).needs_teacher and not teacher:
        return f"algorithm.advantage.kind={advantage} reads a teacher's log-probs, but reward.teacher is not set"
    if teacher and not _estimator(cfg).needs_teacher:
        return (
            f"reward.teacher is served but algorithm.advantage.kind={advantage} does not read its log-probs; "
            "use algorithm.advantage.kind=distill or drop reward.teacher"
        )
    return None


def _group_of_one(cfg: Any) -> str | None:
    advantage = cfg.algorithm.advantage.kind
    if _estimator(cfg).needs_groups and cfg.rollout.group_size < 2:
        return f"rollout.group_size must be >= 2 for {advantage} (advantages are relative to the group)"
    return None


def _groups_split(cfg: Any) -> str | None:
    advantage = cfg.algorithm.advantage.kind
    if _estimator(cfg).needs_groups and cfg.balance.keep_groups is False:
        return (
            f"balance.keep_groups=false would split groups across ranks, but {advantage} "
            "advantages need whole groups on one rank"
        )
    return None


def _passk_beyond_group(cfg: Any) -> str | None:
    k = getattr(cfg.algorithm.advantage, "k", None)
    if cfg.algorithm.advantage.kind == "grpo_passk" and k > cfg.rollout.group_size:
        return f"algorithm.advantage.k={k} must be between 1 and rollout.group_size={cfg.rollout.group_size}"
    return None


def _greedy_baseline_judged(cfg: Any) -> str | None:
    advantage = cfg.algorithm.advantage.kind
    if _estimator(cfg).needs_greedy_baseline and cfg.reward.kind != "rule":
        return (
            f"{advantage} scores its greedy baseline responses with the rule verifier; it needs "
            f"reward.kind=rule, not {cfg.reward.kind}"
        )
    return None


def _values_without_critic(cfg: Any) -> str | None:
    advantage = cfg.algorithm.advantage.kind
    if _estimator(cfg).needs_values and cfg.critic.enabled is False:
        return (
            f"algorithm.advantage.kind={advantage} reads a critic's values, but critic.enabled "
            "is false; set it to true or null"
        )
    return None


def _critic_warmup_whole_run(cfg: Any) -> str | None:
    if cfg.uses_critic and cfg.critic.warmup_steps >= cfg.run.steps:
        return (
            f"critic.warmup_steps={cfg.critic.warmup_steps} would leave no step of run.steps="
            f"{cfg.run.steps} in which the policy trains"
        )
    return None


def _mini_batches_split(cfg: Any) -> str | None:
    if cfg.data.prompts_per_step % cfg.algorithm.mini_batches:
        return (
            f"data.prompts_per_step={cfg.data.prompts_per_step} is not divisible by "
            f"algorithm.mini_batches={cfg.algorithm.mini_batches}"
        )
    return None


def _checkpoint_between_syncs(cfg: Any) -> str | None:
    every = cfg.rollout.sync_every
    if every > 1 and cfg.checkpoint.every % every:
        return (
            f"checkpoint.every={cfg.checkpoint.every} must be a multiple of "
            f"rollout.sync_every={every}: a resumed run pushes the checkpointed policy to the "
            "engines, which is only what they held at a sync step"
        )
    return None


def _engine_too_short(cfg: Any) -> str | None:
    limit = cfg.rollout.engine.max_model_len
    if limit is not None and cfg.rollout_tokens > limit:
        what = (
            "rollout.agent.max_trajectory_tokens"
            if cfg.rollout.multi_turn
            else "data.max_prompt_tokens + rollout.max_new_tokens"
        )
        return f"{what} = {cfg.rollout_tokens} exceeds rollout.engine.max_model_len={limit}"
    return None


def _lacks(entry: Any, capability: str) -> str | None:
    """Why a registered backend lacks `capability` (yatt.backends declares it True, or gives the reason instead),
    or None when it has it."""
    declared = getattr(entry, capability, False)
    return None if declared is True else (declared or f"it does not declare {capability} = True (yatt.backends)")


def _lora_trainer(cfg: Any) -> str | None:
    lora = cfg.model.lora
    if lora.enabled and (why := _lacks(cfg.trainer.backend_entry, "lora")):
        return (
            f"model.lora.rank={lora.rank}: trainer.backend={cfg.trainer.backend} does not train LoRA adapters "
            f"yet: {why}; use trainer.backend=torch or model.lora.rank=0"
        )
    return None


def _lora_engine(cfg: Any) -> str | None:
    lora, engine = cfg.model.lora, cfg.rollout.engine
    if not (lora.enabled and lora.sync == "adapter"):
        return None
    if not getattr(engine.backend_entry, "adapters", False):
        return (
            f"model.lora.sync=adapter: rollout.engine.backend={engine.backend} does not take LoRA adapters (it "
            "does not declare adapters = True, yatt.backends); use model.lora.sync=merged"
        )
    if engine.max_lora_rank is not None and engine.max_lora_rank < lora.rank:
        return (
            f"rollout.engine.max_lora_rank={engine.max_lora_rank} is below model.lora.rank={lora.rank}; "
            "raise it or leave it unset (the run sets it to model.lora.rank)"
        )
    return None


def _agent_no_room(cfg: Any) -> str | None:
    cap = cfg.rollout.agent.max_trajectory_tokens
    if cfg.rollout.multi_turn and cap <= cfg.data.max_prompt_tokens:
        return (
            f"rollout.agent.max_trajectory_tokens={cap} leaves no room for a response after "
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
        )
    return None


def _agent_resume(cfg: Any) -> str | None:
    if cfg.rollout.multi_turn and cfg.rollout.schedule.in_flight == "resume":
        return (
            f"rollout.agent.kind={cfg.rollout.agent.kind} with rollout.schedule.in_flight=resume is not implemented "
            "(a conversation's turns are separate requests whose per-token versions are not kept); use finish"
        )
    return None


def _environment_data(cfg: Any) -> str | None:
    splits = [s for s in ("train", "eval") if getattr(getattr(cfg.data, s), "kind", None) == "verifiers"]
    loop = cfg.rollout.agent.kind
    if splits and loop != "verifiers":
        return (
            f"data.{splits[0]}.kind=verifiers: the environment plays each task with the model and scores it, "
            f"which rollout.agent.kind=verifiers does (it is {loop})"
        )
    if loop == "verifiers" and len(splits) < 1 + (cfg.data.eval is not None):
        split = "train" if "train" not in splits else "eval"
        return f"rollout.agent.kind=verifiers plays verifiers tasks, but data.{split} is not kind: verifiers"
    return None


def _routing_trainer(cfg: Any) -> str | None:
    replay = cfg.algorithm.routing_replay
    if replay != "off" and (why := _lacks(cfg.trainer.backend_entry, "routing_replay")):
        return (
            f"algorithm.routing_replay={replay}: trainer.backend={cfg.trainer.backend} does not replay MoE "
            f"routing: {why}; use trainer.backend=torch or routing_replay=off"
        )
    if cfg.algorithm.routing_mismatch and (why := _lacks(cfg.trainer.backend_entry, "routing_replay")):
        return (
            f"algorithm.routing_mismatch: trainer.backend={cfg.trainer.backend} does not measure MoE routing: "
            f"{why}; use trainer.backend=torch or routing_mismatch=false"
        )
    return None


def _routing_engine(cfg: Any) -> str | None:
    engine = cfg.rollout.engine
    if cfg.algorithm.routing_replay == "r3" and (why := _lacks(engine.backend_entry, "routing_replay")):
        return (
            f"algorithm.routing_replay=r3: rollout.engine.backend={engine.backend} does not return routed "
            f"experts: {why}; use rollout.engine.backend=hf or routing_replay=r2"
        )
    if cfg.algorithm.routing_mismatch and (why := _lacks(engine.backend_entry, "routing_replay")):
        return (
            f"algorithm.routing_mismatch: rollout.engine.backend={engine.backend} does not return routed "
            f"experts: {why}; use rollout.engine.backend=hf or routing_mismatch=false"
        )
    return None


def _routing_r2_without_pass(cfg: Any) -> str | None:
    if cfg.algorithm.routing_replay == "r2" and cfg.algorithm.old_logprobs == "rollout":
        return (
            "algorithm.routing_replay=r2 replays the routing of the trainer's old-log-prob pass, which "
            "algorithm.old_logprobs=rollout skips; use old_logprobs=recompute or reuse, or routing_replay=r3"
        )
    return None


# ---- launch: the ranks launched, a model folder's config.json -------------------------------------------------
def _partial_devices(cfg: Any, world_size: int) -> str | None:
    p = cfg.placement
    if p.mode == "partial" and world_size < p.min_rollout_devices + p.min_genrm_devices:
        return (
            f"placement.mode=partial needs at least {p.min_rollout_devices + p.min_genrm_devices} devices "
            f"(min_rollout_devices + min_genrm_devices), but {world_size} were launched"
        )
    return None


def _prompts_over_ranks(cfg: Any, world_size: int) -> str | None:
    tp, pp = cfg.trainer.model_parallel
    data_ranks = world_size // (tp * pp)  # the ranks of one model-parallel group share one data slice
    per_rank, rest = divmod(cfg.data.prompts_per_step, data_ranks)
    if rest or per_rank % cfg.algorithm.mini_batches:
        return (
            f"data.prompts_per_step={cfg.data.prompts_per_step} must split evenly over {data_ranks} data-parallel "
            f"ranks and then into algorithm.mini_batches={cfg.algorithm.mini_batches}"
        )
    return None


def _streams_over_ranks(cfg: Any, world_size: int) -> str | None:
    tp, pp = cfg.trainer.model_parallel
    data_ranks = world_size // (tp * pp)
    if cfg.data.shards % data_ranks:
        return (
            f"data.shards={cfg.data.shards} train streams cannot be shared out over {data_ranks} data-parallel "
            f"ranks: use a multiple of {data_ranks}"
        )
    return None


def _lora_vision(cfg: Any, world_size: int) -> str | None:
    if cfg.model.lora.enabled and _vision(cfg.model.path):
        return "model.lora: LoRA on a vision-language policy is not supported yet"
    return None


def _agent_images(cfg: Any, world_size: int) -> str | None:
    if cfg.rollout.multi_turn and _vision(cfg.model.path):
        return (
            f"rollout.agent.kind={cfg.rollout.agent.kind}: agent loops take text prompts only, and model.path is a "
            "vision-language policy; use rollout.agent.kind=single_turn"
        )
    return None


def _critic_vision(cfg: Any, world_size: int) -> str | None:
    critic = cfg.critic.model or cfg.model.path
    if cfg.uses_critic and _vision(critic):
        return (
            f"PPO's critic (a one-label token-classification value model) cannot be built from {critic}, a "
            "vision-language model; use an estimator without values (e.g. algorithm.advantage.kind=grpo)"
        )
    return None


def _vocabulary(folder: Path) -> str | None:
    """What decides a folder's token ids, read from its tokenizer files as JSON or bytes (no tokenizer is built):
    tokenizer.json's model vocabulary, merges and added tokens, else vocab.json + merges.txt, else
    tokenizer.model; None when the folder has none of them."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        data = json.loads((folder / "tokenizer.json").read_text())
        model = data.get("model") or {}
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
        return json.dumps([model.get("type"), model.get("vocab"), model.get("merges"), added], sort_keys=True)
    files = [folder / name for name in ("vocab.json", "merges.txt", "tokenizer.model")]
    parts = [f.read_bytes().hex() for f in files if f.is_file()]
    return "".join(parts) or None


def _teacher_tokenizer(cfg: Any, world_size: int) -> str | None:
    teacher = cfg.reward.teacher
    if teacher is None:
        return None
    student, theirs = _vocabulary(cfg.model.path), _vocabulary(teacher.model)
    if student is not None and theirs is not None and student != theirs:
        return (
            f"reward.teacher.model={teacher.model} has another tokenizer than model.path={cfg.model.path}: the "
            "teacher scores the student's token ids, so both need the same vocabulary (cross-tokenizer "
            "distillation is not implemented)"
        )
    if _vision(cfg.model.path) or _vision(teacher.model):
        return "reward.teacher: distillation of vision-language policies (image prompts) is not implemented"
    return None


def _teacher_context(cfg: Any, world_size: int) -> str | None:
    teacher = cfg.reward.teacher
    if teacher is None:
        return None
    context = teacher.engine.max_model_len or _model_config(teacher.model).get("max_position_embeddings")
    if context is not None and cfg.rollout_tokens + 1 > context:
        return (
            f"reward.teacher scores prompt + response ({cfg.rollout_tokens} tokens) and one more, but its context is "
            f"{context} (reward.teacher.engine.max_model_len or its max_position_embeddings)"
        )
    return None


def _megatron_model(cfg: Any, world_size: int) -> str | None:
    if cfg.trainer.backend != "megatron":
        return None
    from yatt.trainers.megatron_config import model_refusal  # light: the section and this check only

    own = cfg.trainer.backend_config  # trainer.megatron
    return model_refusal(_model_config(cfg.model.path), *cfg.trainer.model_parallel, own.expert_parallel)


REFUSALS: list[Refusal] = [
    Refusal("rollout.schedule.mode (not sync) + rollout.sync_every > 1",
            "an ahead schedule decides which weights each batch is generated with", _ahead_sync_every),
    Refusal("rollout.schedule.in_flight=resume + mode=sync",
            "the sync schedule never pushes weights while requests are in flight", _resume_in_sync),
    Refusal("placement.mode=partial + no reward.judges and no reward.teacher",
            "partial placement splits the devices between rollout and a judge (or teacher)", _partial_without_judge),
    Refusal("algorithm.advantage.kind=distill without reward.teacher, or reward.teacher with another advantage",
            "the teacher's log-probs are the distillation advantage, and nothing else reads them", _teacher_unread),
    Refusal("a group advantage (grpo, rloo, ...) + rollout.group_size < 2",
            "its advantages are relative to the group", _group_of_one),
    Refusal("a group advantage + balance.keep_groups=false",
            "balancing would split a group over ranks", _groups_split),
    Refusal("algorithm.advantage.kind=grpo_passk + k > rollout.group_size",
            "pass@k needs k samples of the group", _passk_beyond_group),
    Refusal("a greedy-baseline advantage (remax) + reward.kind other than rule",
            "the baseline responses are scored by the rule verifier", _greedy_baseline_judged),
    Refusal("algorithm.advantage.kind=gae + critic.enabled=false", "GAE reads a critic's values",
            _values_without_critic),
    Refusal("critic.warmup_steps >= run.steps", "the policy would never train", _critic_warmup_whole_run),
    Refusal("data.prompts_per_step not divisible by algorithm.mini_batches",
            "each mini-batch takes whole prompts", _mini_batches_split),
    Refusal("rollout.sync_every > 1 + checkpoint.every not a multiple of it",
            "a resumed run pushes the checkpointed policy, which engines held only at a sync step",
            _checkpoint_between_syncs),
    Refusal("rollout.engine.max_model_len < the longest prompt + response (or trajectory)",
            "the engine could not hold a rollout", _engine_too_short),
    Refusal("model.lora + a trainer backend without LoRA (megatron)",
            "only the torch backend trains adapters", _lora_trainer),
    Refusal("model.lora.sync=adapter + an engine without adapters (hf), or max_lora_rank < rank",
            "the engine must serve the adapters it is sent", _lora_engine),
    Refusal("an agent loop + rollout.agent.max_trajectory_tokens <= data.max_prompt_tokens",
            "no room for a response", _agent_no_room),
    Refusal("an agent loop + rollout.schedule.in_flight=resume",
            "a conversation's turns are separate requests whose versions are not kept", _agent_resume),
    Refusal("data.train/eval.kind=verifiers + rollout.agent.kind other than verifiers, or the reverse",
            "the environment plays its tasks and gives their reward through its own loop", _environment_data),
    Refusal("algorithm.routing_replay (not off) or routing_mismatch + a trainer backend without routing replay "
            "(a plug-in that does not declare it)",
            "the trainer replays and measures MoE routing", _routing_trainer),
    Refusal("algorithm.routing_replay=r3 or routing_mismatch + an engine that does not return routed experts (vllm)",
            "R3 replays the experts the engine routed to; vLLM 0.32 captures them on GPUs only", _routing_engine),
    Refusal("algorithm.routing_replay=r2 + algorithm.old_logprobs=rollout",
            "R2 replays the routing of the trainer's old-log-prob pass, which rollout skips", _routing_r2_without_pass),
    Refusal("placement.mode=partial + fewer ranks than min_rollout_devices + min_genrm_devices",
            "each role needs its devices", _partial_devices, launch=True),
    Refusal("data.prompts_per_step not splitting over the data-parallel ranks and mini-batches",
            "every rank trains the same number of prompts per mini-batch", _prompts_over_ranks, launch=True),
    Refusal("data.shards not a multiple of the data-parallel ranks",
            "each rank draws from whole streams of prompts", _streams_over_ranks, launch=True),
    Refusal("model.lora + a vision-language policy", "LoRA adapts the text decoder only, not yet a VL policy",
            _lora_vision, launch=True),
    Refusal("an agent loop + a vision-language policy (image prompts)", "agent loops take text prompts only",
            _agent_images, launch=True),
    Refusal("PPO's critic (critic.enabled, or an estimator reading values) + a vision-language critic.model",
            "value models are token-classification text models", _critic_vision, launch=True),
    Refusal("reward.teacher with another tokenizer than model.path, or a vision-language policy or teacher",
            "the teacher scores the student's token ids (tokenizer files compared)", _teacher_tokenizer, launch=True),
    Refusal("reward.teacher with a context shorter than prompt + response + 1",
            "the teacher scores the whole sample and samples one token", _teacher_context, launch=True),
    Refusal("trainer.backend=megatron + a model type, activation or split it does not map",
            "the megatron backend maps qwen2, llama, qwen3 and qwen3_moe folders (config.json)", _megatron_model,
            launch=True),
]  # fmt: skip


def config_refusals(cfg: Any) -> None:
    """Raise ValueError with the first refusal the config alone decides (called by validation)."""
    for refusal in REFUSALS:
        if not refusal.launch and (why := refusal.check(cfg)):
            raise ValueError(why)


def launch_refusals(cfg: Any, world_size: int) -> str | None:
    """The first refusal that needs the ranks launched or a model folder (called by yatt.preflight)."""
    for refusal in REFUSALS:
        if refusal.launch and (why := refusal.check(cfg, world_size)):
            return why
    return None
