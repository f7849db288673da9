"""The held-out evaluation: greedy responses to this rank's eval rows from its own rollout engines, scored by
the rule verifier, and summed over ranks: eval/accuracy is the fraction of prompts with a full score
(verifier score >= 1), eval/score the mean verifier score (partial credit counts)."""

from __future__ import annotations

import time

from yatt.controllers.conversations import Agent
from yatt.controllers.images import load_batch_images
from yatt.controllers.metrics import loop_metrics
from yatt.controllers.rollouts import generate_rollouts, score_rollouts
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow
from yatt.distributed import World
from yatt.engines.base import SamplingSpec
from yatt.models.vision import ImageInputs
from yatt.placement.engine_lifecycle import ROLLOUT, EngineServices
from yatt.placement.metrics import summed
from yatt.placement.ownership import DeviceOwnership


def eval_metrics(s: dict[str, float]) -> dict[str, float]:
    """The metrics from the evaluation's sums over ranks (full, score, count)."""
    return {"eval/accuracy": s["full"] / s["count"], "eval/score": s["score"] / s["count"], "eval/count": s["count"]}


def evaluate_greedy(
    world: World,
    engines: EngineServices,
    placement: DeviceOwnership,
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    image_inputs: ImageInputs | None,
    greedy: SamplingSpec,
    tokenizer,
    agent: Agent,
) -> tuple[dict[str, float], list[Rollout]]:
    """The evaluation's metrics (the same on every rank) and this rank's scored rollouts (for samples.jsonl).
    `agent`: how each sample unfolds (rollout.agent); a multi-turn loop's tool-call counts go in eval/agent/*."""
    start, rollouts = time.perf_counter(), []
    if rows:  # a rank may hold no held-out rows; it still joins the sums
        images = load_batch_images(rows, image_inputs, prompt_ids)  # read for this evaluation only
        with placement.own("rollout"):
            rollouts = generate_rollouts(
                engines.pool(ROLLOUT, [world.rank]), rows, prompt_ids, greedy, tokenizer, None, agent, images
            )
        score_rollouts(rollouts)
    sums = summed(
        world,
        {
            "full": float(sum(r.reward >= 1.0 for r in rollouts)),
            "score": float(sum(r.reward for r in rollouts)),
            "count": float(len(rollouts)),
        },
    )
    metrics = {**eval_metrics(sums), "time/eval_s": time.perf_counter() - start}
    if agent.multi_turn:
        metrics.update(loop_metrics(world, rollouts, "eval/"))
    return metrics, rollouts
