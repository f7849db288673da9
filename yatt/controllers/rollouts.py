"""Rollouts of one rank: prompts -> G sampled responses each (with the engine's logprobs) -> rewards (and
ReMax's greedy baselines) -> rebalanced over ranks."""

from __future__ import annotations

import hashlib

from yatt.agents.base import Trajectory
from yatt.balance.exchange import Plan, rebalance
from yatt.config import BalanceConfig
from yatt.controllers.conversations import Agent, agent_rollouts
from yatt.data.images import PromptImages
from yatt.data.prepare import encode_prompts  # noqa: F401  (re-exported: the step encodes its batch)
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow
from yatt.distributed import World
from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.pool import EnginePool, Request
from yatt.rewards.rules import score_rollout


def sample_seed(run_seed: int, step: int, row_index: int, round_: int = 0) -> int:
    """A sampling seed fixed by (run, step, prompt), so a rerun or resume draws the same samples.

    `round_` > 0 names a dynamic-sampling refill round, in which a prompt may come round again.
    """
    key = f"{run_seed}:{step}:{row_index}" + (f":{round_}" if round_ else "")
    digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def generate_rollouts(
    pool: EnginePool,
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    sampling: SamplingSpec,
    tokenizer,
    seeds: list[int] | None,
    agent: Agent,
    images: list[PromptImages | None] | None = None,
) -> list[Rollout]:
    """G samples per prompt, consecutive in the result (a GRPO group is rows [g*G, (g+1)*G)). `images`: the
    rows' loaded images (yatt.controllers.images), None for text rows. `agent`: how each sample unfolds
    (yatt.controllers.conversations: single_turn's one generate call, or a conversation).

    Through a pool, so an engine that dies during the call is replaced (or its prompts re-routed) and only
    its unanswered prompts are sent again, with the same seeds: the result is what a live engine gives."""
    seeds = seeds if seeds is not None else [None] * len(prompt_ids)
    images = images or [None] * len(rows)
    requests = [
        Request(f"p{i}", ids, seed, sampling, im.images if im else None)
        for i, (ids, seed, im) in enumerate(zip(prompt_ids, seeds, images))
    ]
    pool = agent.pool(pool, {req.key: row for req, row in zip(requests, rows)})
    pool.submit(requests)
    done = pool.drain()
    return [
        r
        for i, (row, ids, im) in enumerate(zip(rows, prompt_ids, images))
        for r in group_rollouts(row, ids, im, done[f"p{i}"], tokenizer)
    ]


def group_rollouts(
    row: PromptRow,
    prompt_ids: list[int],
    image: PromptImages | None,
    completions: list[Completion] | list[Trajectory],
    tokenizer,
) -> list[Rollout]:
    """One prompt's rollouts from its engine completions (or an agent loop's trajectories): an image prompt's
    samples carry the expanded ids and share its one PromptImages (the images are not copied per sample)."""
    if completions and isinstance(completions[0], Trajectory):
        return agent_rollouts(row, prompt_ids, completions)
    return [
        Rollout(
            row,
            image.prompt_ids if image else prompt_ids,
            list(c.token_ids),
            list(c.logprobs),
            c.finish_reason,
            text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
            version=c.versions[0] if c.versions else -1,
            token_versions=list(c.versions),
            vision=image,
            routed_experts=c.routed_experts,
        )
        for c in completions
    ]


def score_rollouts(rollouts: list[Rollout]) -> None:
    """Rule rewards (or the environment's own), in place."""
    for r in rollouts:
        r.reward = score_rollout(r)


def set_greedy_baselines(
    rollouts: list[Rollout],
    pool: EnginePool,
    greedy: SamplingSpec,
    group_size: int,
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    images: list[PromptImages | None],
    tokenizer,
    agent: Agent,
) -> None:
    """ReMax, in place: one greedy response per prompt (a greedy conversation with an agent loop), generated
    right after its group and scored by the rule verifier (the config allows ReMax with reward.kind=rule only);
    its reward is each sample's baseline."""
    responses = generate_rollouts(pool, rows, prompt_ids, greedy, tokenizer, None, agent, images)
    score_rollouts(responses)
    for i, g in enumerate(responses):
        for r in rollouts[i * group_size : (i + 1) * group_size]:
            r.baseline = g.reward


def rebalance_groups(
    world: World, rollouts: list[Rollout], cfg: BalanceConfig, group_size: int
) -> tuple[list[Rollout], Plan | None]:
    """What this rank trains: its own and moved rollouts, whole groups (or samples, balance.keep_groups=false)
    moved between ranks so each trains about the same work (yatt.balance). Off: no exchange and no plan (the
    step's metrics report the imbalance)."""
    if not cfg.enabled:
        return rollouts, None
    for i, r in enumerate(rollouts):
        r.origin = (world.rank, i)
    unit = group_size if cfg.keep_groups is not False else 1
    return rebalance(world, rollouts, unit, cfg.attention_coef, cfg.partitioner, cfg.equal_count)
