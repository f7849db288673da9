"""A rollout: one sampled response with everything the step learns about it (log-probs, scores, reward)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from yatt.data.rows import PromptRow


@dataclass
class Rollout:
    """One sampled response to a prompt, from generation to the loss.

    A rollout that load balancing moved to another rank carries only what training needs (ids, log-probs, the
    response mask, reward, finish reason): its `row` is None and its text empty there. With an agent loop `text`
    is the last model turn (what the reward reads) and the response holds every turn and tool response.
    """

    row: PromptRow | None
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    rule_score: float = 0.0
    judge_scores: dict[str, float] = field(default_factory=dict)
    origin: tuple[int, int] = (-1, -1)  # (rank, index in that rank's step) where it was generated
    baseline: float = 0.0  # ReMax: the reward of the prompt's greedy response (0 unless the estimator asks)
    # the policy version that generated every token: the step whose weights the engine held (rollout.schedule)
    version: int = -1
    # the version of each response token when its generation was resumed across pushes (rollout.schedule.in_flight:
    # resume; `version` is then the first token's); empty: every token is `version`'s
    token_versions: list[int] = field(default_factory=list)
    # an image prompt's loaded images (yatt.controllers.images.PromptImages; the group's samples share one), read
    # for this step and dropped with the rollout; prompt_ids are then the expanded ids
    vision: Any = None
    # an agent loop's trajectory (rollout.agent): 1 where the model sampled response_ids[i] (trained on), 0 where
    # the environment added it (tool responses: context, never loss; rollout_logprobs 0.0 there); empty: all 1
    response_mask: list[int] = field(default_factory=list)
    # an agent loop's counts for this trajectory (yatt.agents.base.Trajectory: num_turns, tool_calls,
    # malformed_tool_calls, tool_errors); empty for single_turn
    agent_stats: dict[str, float] = field(default_factory=dict)
    # routing replay r3 on a mixture-of-experts policy: per prompt and response token, the experts each MoE layer
    # routed it to in the engine (layers x k ints, layer-major; -1s where none was recorded); empty: none
    routed_experts: list[list[int]] = field(default_factory=list)
    # on-policy distillation (reward.teacher): the teacher's log-prob of each response token given the prompt and
    # the response before it (raw logits, yatt.genrm.teacher); empty without a teacher
    teacher_logprobs: list[float] = field(default_factory=list)
    # the environment's own reward of an agent loop's trajectory (Trajectory.reward: e.g. a verifiers game's); when
    # set it is the rollout's rule score (yatt.rewards.rules.score_rollout); None: the row's verifier scores `text`
    env_reward: float | None = None
    # the environment's named scores of the trajectory (Trajectory.scores), logged as their means
    # (yatt.controllers.metrics.env_score_metrics); empty: none
    env_scores: dict[str, float] = field(default_factory=dict)

    def loss_mask(self) -> list[int]:
        """Per response id: 1 where the trainer scores it (model tokens), 0 for environment tokens."""
        return self.response_mask or [1] * len(self.response_ids)

    def to_dict(self) -> dict:
        """Plain JSON-able data (for state that checkpoints carry, e.g. the dynamic-sampling queue); an image
        rollout's pixels are not part of it."""
        return asdict(replace(self, vision=None))

    @classmethod
    def from_dict(cls, d: dict) -> "Rollout":
        return cls(**{**d, "row": PromptRow(**d["row"]) if d["row"] is not None else None,
                      "origin": tuple(d.get("origin", (-1, -1)))})
