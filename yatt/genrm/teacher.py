"""On-policy distillation's teacher at run time: a student's sample -> the teacher's log-prob of each response token.

The teacher is an engine like a judge's (its role is `teacher`, on the genrm devices of the placement), but it is
asked to score token ids rather than to write a verdict: each sample's prompt + response ids go to it with
`SamplingSpec.prompt_logprobs` and max_tokens 1 (engines have no generate-free call; the one token it samples
is dropped), and the prompt log-probs of the response positions come back onto the rollout
(`Rollout.teacher_logprobs`). The log-probs are of the teacher's raw logits (temperature 1): the estimator
compares them with the student's log-probs of the same tokens (yatt.algorithms.distill).

Read after yatt.genrm.judge; yatt.controllers.generation sends the requests and takes the answers.
"""

from __future__ import annotations

from yatt.data.rollout import Rollout
from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.config import EngineConfig
from yatt.genrm.config import TeacherConfig
from yatt.genrm.judge import judge_engine

TEACHER = "teacher"  # the teacher's engine role, lane and metrics prefix (judges' roles are genrm-<name>)


def teacher_engine(cfg: TeacherConfig) -> EngineConfig:
    """The teacher's engine config, its context defaulting to the model's (as a judge's)."""
    return judge_engine(cfg)


class Teacher:
    def __init__(self, cfg: TeacherConfig):
        self.cfg = cfg
        # n=1 and greedy: the sampled token is thrown away; only the prompt's scores matter
        self.sampling = SamplingSpec(n=1, temperature=0.0, max_tokens=1, logprobs=False, prompt_logprobs=True)
        self.max_ids = teacher_engine(cfg).max_model_len - self.sampling.max_tokens

    def request(self, rollout: Rollout) -> list[int]:
        """The ids the teacher scores: the student's prompt and response, as the student saw them."""
        ids = [*rollout.prompt_ids, *rollout.response_ids]
        if len(ids) > self.max_ids:  # the launch checks make this unreachable for single-turn rollouts
            raise ValueError(
                f"reward.teacher: a sample of {len(ids)} tokens does not fit the teacher's context "
                f"({self.max_ids} + 1); raise reward.teacher.engine.max_model_len"
            )
        return ids

    def take(self, rollout: Rollout, completions: list[Completion]) -> None:
        """Rollout.teacher_logprobs := the teacher's log-prob of each response token given all before it."""
        scored = completions[0].prompt_logprobs
        n = len(rollout.response_ids)
        if len(scored) != len(rollout.prompt_ids) + n - 1:
            total = len(rollout.prompt_ids) + n
            raise RuntimeError(f"the teacher scored {len(scored)} tokens of a {total}-token sample")
        rollout.teacher_logprobs = scored[len(scored) - n :] if n else []
