"""GroupShare (yatt.controllers.generation): how the ranks of a model-parallel group split a data-parallel rank's
prompts, and that a share is judged with the seeds the whole batch would have had."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from yatt.agents.config import AgentConfig
from yatt.controllers.conversations import Agent
from yatt.controllers.generation import GenerationStats, GroupShare, JudgeLane, generate_and_judge
from yatt.data.rows import PromptRow
from yatt.distributed import World
from yatt.engines.base import Completion, SamplingSpec
from yatt.genrm.config import JudgeConfig
from yatt.genrm.judge import Judge
from yatt.models.tiny import TinyModelConfig, write_tiny_model

CPU = torch.device("cpu")


def group(rank: int, size: int) -> GroupShare:
    world = World(rank, size, rank, CPU)
    return GroupShare(world, world, World(0, 1, 0, CPU))


def test_shares_are_contiguous_and_cover_the_batch():
    for count, size in [(8, 2), (5, 2), (1, 2), (7, 4), (0, 2)]:
        shares = [group(r, size).share(count) for r in range(size)]
        assert [i for s in shares for i in range(count)[s]] == list(range(count))
        assert max(s.stop - s.start for s in shares) - min(s.stop - s.start for s in shares) <= 1


def test_without_a_group_a_rank_generates_everything_and_sums_over_data_parallel_ranks():
    data = World(0, 1, 0, CPU)
    share = GroupShare(None, World(0, 2, 0, CPU), data)
    assert share.share(6) == slice(0, 6) and share.sums is data
    stats = GenerationStats(rollout_s=1.0, judged=3)
    assert share.gather(["r"], stats) == (["r"], stats)


class AnswerAtOnce:
    """A pool that answers each request with one fixed completion and records what it was sent (a fake for
    observing the requests; the real pools are exercised by the end-to-end tests)."""

    def __init__(self, completion: Completion):
        self.completion, self.sent, self.answers, self.max_queue = completion, [], [], 0

    def submit(self, requests):
        self.sent += requests
        self.answers += [(r.key, [self.completion] * r.sampling.n) for r in requests]

    def in_flight(self) -> int:
        return len(self.answers)

    def poll(self, max_wait_s: float = 0.0):
        out, self.answers = self.answers, []
        return out

    def drain(self, on_result=None):
        for key, completions in self.poll():
            on_result(key, completions)

    def take_metrics(self, prefix: str) -> dict:
        return {}


def test_a_share_is_judged_with_the_whole_batchs_seeds(tmp_path):
    policy = write_tiny_model(tmp_path / "m", TinyModelConfig(alphabet="0123456789+=:?yesno"), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    judge = Judge(JudgeConfig(name="j", model=policy, template="{question}{reference}:{response}?"))
    rows = [PromptRow(i, f"{i}+1=", None, str(i + 1), "exact_match") for i in range(4)]
    ids = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in rows]
    sampling = SamplingSpec(n=2, temperature=1.0, max_tokens=1, logprobs=True)
    answer = Completion(
        token_ids=tokenizer("3", add_special_tokens=False)["input_ids"], logprobs=[-0.5], finish_reason="length"
    )

    def judge_seeds(part: slice, stream: bool) -> list[int]:
        lane = JudgeLane(judge, AnswerAtOnce(answer))
        generate_and_judge(
            rows[part], ids[part], [7] * 4, sampling, tokenizer, AnswerAtOnce(answer), {"j": lane},
            step=3, run_seed=0, stream=stream, first_group=part.start, agent=Agent.build(AgentConfig(), tokenizer),
        )  # fmt: skip
        return [r.seed for r in lane.pool.sent]

    for stream in (False, True):
        whole = judge_seeds(slice(0, 4), stream)
        assert len(set(whole)) == 8  # a seed per group and sample
        assert judge_seeds(slice(0, 2), stream) + judge_seeds(slice(2, 4), stream) == whole
