"""The generation phase of a step: sample G responses per prompt, and have the judges (and a distillation
teacher) read them.

`stream=False` (full colocation): all rollouts finish, then the device changes owner, then the
judges run. `stream=True` (partial colocation): rollout and judge engines run at the same time on
different devices, and each prompt's group goes to a judge the moment it is finished, so judging
overlaps the slowest rollouts instead of waiting for them. `generate_placed` picks the mode and the engines
from the placement; `generate_and_judge` runs it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from yatt.config import RolloutConfig
from yatt.controllers.conversations import Agent
from yatt.controllers.rollouts import group_rollouts
from yatt.data.images import PromptImages
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow
from yatt.distributed import World
from yatt.engines.base import SamplingSpec
from yatt.engines.pool import EnginePool, Request
from yatt.genrm.judge import Judge
from yatt.genrm.mixing import mix_rewards
from yatt.genrm.teacher import TEACHER, Teacher
from yatt.placement.engine_lifecycle import ROLLOUT, EngineServices, genrm_role
from yatt.placement.ownership import DeviceOwnership
from yatt.placement.plan import GenerationSplit
from yatt.rewards.rules import score_rollout


def judge_seed(run_seed: int, step: int, group: int, sample: int, judge: str) -> int:
    digest = hashlib.blake2b(f"judge:{judge}:{run_seed}:{step}:{group}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class JudgeLane:
    """A judge and the engines that serve it: a finished group's responses in, a verdict per response back."""

    judge: Judge
    pool: EnginePool

    @property
    def metrics_prefix(self) -> str:
        return f"genrm/{self.judge.cfg.name}"

    def requests(self, key: str, group: list[Rollout], tokenizer, pictures, seeds: list[int]) -> list[Request]:
        out = []
        for j, r in enumerate(group):
            text = judged_text(r, self.judge, tokenizer)
            ids, seen = self.judge.request(r.row.question(), r.row.answer, text, pictures)
            out.append(Request(f"{key}/{j}", ids, seeds[j], self.judge.sampling, seen))
        return out

    def take(self, rollout: Rollout, completions, stats: GenerationStats) -> None:
        verdict = self.judge.score(completions)
        rollout.judge_scores[self.judge.cfg.name] = verdict.score
        stats.judged += 1
        stats.unparseable += verdict.unparseable


@dataclass
class TeacherLane:
    """On-policy distillation's teacher and its engines, placed like a judge's: a finished group's prompt +
    response ids in, the teacher's log-prob of every response token back (yatt.genrm.teacher)."""

    teacher: Teacher
    pool: EnginePool
    metrics_prefix: str = TEACHER

    def requests(self, key: str, group: list[Rollout], tokenizer, pictures, seeds: list[int]) -> list[Request]:
        sampling = self.teacher.sampling  # greedy, one token: no seed
        return [Request(f"{key}/{j}", self.teacher.request(r), None, sampling) for j, r in enumerate(group)]

    def take(self, rollout: Rollout, completions, stats: GenerationStats) -> None:
        self.teacher.take(rollout, completions)


Lane = JudgeLane | TeacherLane


def reading_lanes(engines: EngineServices, ranks, judges: dict[str, Judge], teacher: Teacher | None) -> dict[str, Lane]:
    """The lanes that read each finished group, by engine role: every judge's, and the teacher's, over the engines
    of their roles on `ranks`."""
    lanes: dict[str, Lane] = {
        genrm_role(name): JudgeLane(judge, engines.pool(genrm_role(name), ranks)) for name, judge in judges.items()
    }
    if teacher is not None:
        lanes[TEACHER] = TeacherLane(teacher, engines.pool(TEACHER, ranks))
    return lanes


@dataclass
class GenerationStats:
    rollout_s: float = 0.0  # submit -> last rollout group back
    judge_tail_s: float = 0.0  # last rollout group -> last verdict (the judging not hidden by rollout)
    judged: int = 0
    unparseable: int = 0
    max_judge_queue: int = 0
    pools: dict[str, float] = field(default_factory=dict)  # re-routed / respawned / duplicate counts

    @classmethod
    def merged(cls, rounds: list[GenerationStats]) -> GenerationStats:
        """One step's stats from its generation rounds (several with dynamic sampling)."""
        out = cls()
        for r in rounds:
            out.rollout_s += r.rollout_s
            out.judge_tail_s += r.judge_tail_s
            out.judged += r.judged
            out.unparseable += r.unparseable
            out.max_judge_queue = max(out.max_judge_queue, r.max_judge_queue)
            for k, v in r.pools.items():
                out.pools[k] = out.pools.get(k, 0.0) + v
        return out


class GroupShare:
    """How the ranks of one model-parallel group (TP x PP, yatt.distributed.model_parallel_world) generate their
    data-parallel rank's prompts: each takes a contiguous share on its own device's engines, with the prompts'
    unchanged seeds, then the group gathers the scored rollouts in prompt order, so every rank of the group
    trains on the same batch and it is the batch one rank would have generated alone. `group` None: this rank
    holds the whole model and generates all its prompts."""

    def __init__(self, group: World | None, devices: World, data: World):
        self.group = group
        # whom sums over shares go to (e.g. the evaluation's): the shares of all groups partition all rows
        self.sums = data if group is None else devices

    def share(self, count: int) -> slice:
        """This rank's part of `count` prompts (the first ranks take one more when it does not divide)."""
        if self.group is None:
            return slice(0, count)
        size, rank = self.group.size, self.group.rank
        per, extra = divmod(count, size)
        start = rank * per + min(rank, extra)
        return slice(start, start + per + (rank < extra))

    def gather(self, rollouts: list[Rollout], stats: GenerationStats) -> tuple[list[Rollout], GenerationStats]:
        """The group's rollouts in prompt order, and its generation stats (counts summed, times and queues maxed)."""
        if self.group is None:
            return rollouts, stats
        parts = self.group.all_gather_object((rollouts, stats))
        merged = GenerationStats.merged([s for _, s in parts])
        merged.rollout_s, merged.judge_tail_s = (
            max(s.rollout_s for _, s in parts),
            max(s.judge_tail_s for _, s in parts),
        )
        return [r for part, _ in parts for r in part], merged


def generate_placed(
    engines: EngineServices,
    placement: DeviceOwnership,
    split: GenerationSplit | None,
    rank: int,
    judges: dict[str, Judge],
    teacher: Teacher | None = None,
    **kwargs,
) -> tuple[list[Rollout], GenerationStats]:
    """generate_and_judge (given `kwargs` but the engines) on the devices the placement gives each role. Full
    (no split): this device rolls out, then changes owner and judges. Partial: the split's rollout and GenRM
    devices at once, each group judged as soon as it is back. The `teacher` (on-policy distillation) reads the
    groups like a judge, on the same devices."""
    if split is None:
        lanes = reading_lanes(engines, [rank], judges, teacher)
        with placement.own("rollout"):
            return generate_and_judge(
                rollout_pool=engines.pool(ROLLOUT, [rank]),
                lanes=lanes,
                stream=False,
                before_judging=lambda: placement.acquire("genrm"),
                **kwargs,
            )
    lanes = reading_lanes(engines, split.genrm, judges, teacher)
    with placement.own(split.role_of(rank)):
        return generate_and_judge(rollout_pool=engines.pool(ROLLOUT, split.rollout), lanes=lanes, stream=True, **kwargs)


def generate_and_judge(
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    seeds: list[int],
    sampling: SamplingSpec,
    tokenizer,
    rollout_pool: EnginePool,
    lanes: dict[str, Lane],
    *,
    step: int,
    run_seed: int,
    stream: bool,
    round_: int = 0,
    first_group: int = 0,
    before_judging: Callable[[], None] | None = None,
    images: list[PromptImages | None] | None = None,
    agent: Agent,
) -> tuple[list[Rollout], GenerationStats]:
    """Rollouts in prompt order (group g = rows [g*G, (g+1)*G)) with rule and judge scores filled in.
    `agent`: how each sample unfolds on the rollout engines (yatt.controllers.conversations: single_turn's one
    request per prompt, or a conversation per sample), a group going to the judges once its G samples have ended.
    `images`: the rows' loaded images (yatt.controllers.images); engines get the placeholder ids and the bytes,
    the rollouts the expanded ids and the pixels, a vision-language judge the bytes with its own prompt
    (Judge.request). `first_group`: the index of rows[0]'s group in the data-parallel rank's batch
    (GroupShare), so a judge's seeds do not depend on how the batch was split."""
    stats = GenerationStats()
    groups: dict[int, list[Rollout]] = {}
    start = time.perf_counter()
    images = images or [None] * len(rows)
    requests = [
        Request(f"s{step}r{round_}/g{g}", ids, seed, sampling, im.images if im else None)
        for g, (ids, seed, im) in enumerate(zip(prompt_ids, seeds, images))
    ]
    rollout_pool = agent.pool(rollout_pool, {req.key: row for req, row in zip(requests, rows)})
    rollout_pool.submit(requests)

    def judge_group(g: int) -> None:
        pictures = images[g].images if images[g] else None  # a VL judge sees them (Judge.request), a text one not
        for role, lane in lanes.items():
            name = role.removeprefix("genrm-")  # a judge's seeds by its name, as before lanes were keyed by role
            group = round_ * 1_000_000 + first_group + g
            seeds = [judge_seed(run_seed, step, group, j, name) for j in range(len(groups[g]))]
            lane.pool.submit(lane.requests(f"s{step}r{round_}/g{g}", groups[g], tokenizer, pictures, seeds))

    def take_rollouts(key: str, completions) -> None:
        g = int(key.rsplit("/g", 1)[1])
        groups[g] = group_rollouts(rows[g], prompt_ids[g], images[g], completions, tokenizer)
        for r in groups[g]:
            r.rule_score = score_rollout(r)
        if stream and lanes:
            judge_group(g)

    def take_verdicts(role: str) -> Callable:
        def take(key: str, completions) -> None:
            _, g, j = key.split("/")
            lanes[role].take(groups[int(g[1:])][int(j)], completions, stats)

        return take

    if stream and lanes:  # both kinds of engines at once: poll each in turn until all is back
        takers = {name: take_verdicts(name) for name in lanes}
        while rollout_pool.in_flight() or any(lane.pool.in_flight() for lane in lanes.values()):
            for key, completions in rollout_pool.poll(0.01):
                take_rollouts(key, completions)
            if not rollout_pool.in_flight() and not stats.rollout_s:
                stats.rollout_s = time.perf_counter() - start
            for name, lane in lanes.items():
                for key, completions in lane.pool.poll(0.01):
                    takers[name](key, completions)
    else:
        rollout_pool.drain(take_rollouts)
        stats.rollout_s = time.perf_counter() - start
        if lanes:
            if before_judging:
                before_judging()
            for g in sorted(groups):
                judge_group(g)
            for name, lane in lanes.items():
                lane.pool.drain(take_verdicts(name))
    stats.rollout_s = stats.rollout_s or time.perf_counter() - start
    stats.judge_tail_s = time.perf_counter() - start - stats.rollout_s
    rollouts = [r for g in range(len(rows)) for r in groups[g]]
    stats.max_judge_queue = max((lane.pool.max_queue for lane in lanes.values()), default=0)  # the pools track it
    for prefix, pool in [("rollout", rollout_pool)] + [(lane.metrics_prefix, lane.pool) for lane in lanes.values()]:
        for key, value in pool.take_metrics(prefix).items():
            stats.pools[key] = stats.pools.get(key, 0.0) + value
    return rollouts, stats


def judged_text(rollout: Rollout, judge: Judge, tokenizer) -> str:
    """The response a judge reads (judges[].reads): the last model turn (Rollout.text), or a multi-turn
    rollout's whole response, tool turns included, with its turn markers."""
    if judge.cfg.reads == "final" or not rollout.response_mask:
        return rollout.text
    return tokenizer.decode(rollout.response_ids, skip_special_tokens=False)


def sampling_specs(rollout: RolloutConfig, eos: int, routed_experts: bool = False) -> tuple[SamplingSpec, SamplingSpec]:
    """The step's sampling (G samples with log-probs, and with `routed_experts` the experts of every token:
    routing replay r3) and the greedy decoding of evaluation and ReMax."""
    sampling = SamplingSpec(
        n=rollout.group_size,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_tokens=rollout.max_new_tokens,
        stop_token_ids=[eos],
        logprobs=True,
        routed_experts=routed_experts,
    )
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=rollout.max_new_tokens, stop_token_ids=[eos], logprobs=False)
    return sampling, greedy


def assign_rewards(rollouts: list[Rollout], mode: str, judge_weights: dict[str, float], rule_weight: float) -> None:
    """Rollout.reward from the rule score and the judges' scores (see yatt.genrm.mixing)."""
    rule = torch.tensor([r.rule_score for r in rollouts], dtype=torch.float64)
    judges = {
        name: torch.tensor([r.judge_scores[name] for r in rollouts], dtype=torch.float64) for name in judge_weights
    }
    rewards = mix_rewards(mode, rule, judges, judge_weights, rule_weight)
    for r, value in zip(rollouts, rewards.tolist()):
        r.reward = float(value)
