"""verifiers tasks scored by their own functions (docs/environments.md "Single-turn environments and scoring
functions"): the single-turn environment package environments/vf-reasoning-gym (reasoning-gym's scorer as a
`@vf.reward` over the trace) played by the rollout.agent.kind=verifiers loop, one reply per task; the verifiers
Trace that a task's `@stop`, `@reward` and `@metric` functions read; and what the in-process route refuses.

Needs the verifiers package and the environment package (`make setup` installs both); skipped without them. The
run through launch/train.py on 2 ranks is the composition matrix's single-turn environment row."""

from __future__ import annotations

import pytest

vf = pytest.importorskip("verifiers.v1", reason="needs the verifiers package (make setup installs it)")
pytest.importorskip("vf_reasoning_gym", reason="needs environments/vf-reasoning-gym (make setup installs it)")

import reasoning_gym  # noqa: E402
from test_verifiers_env import CODEC, END, TOK  # noqa: E402

from yatt.agents.config import AgentConfig  # noqa: E402
from yatt.agents.environment import EnvironmentLoop  # noqa: E402
from yatt.envs.episode import CAPPED, named_scores, run_episode  # noqa: E402
from yatt.envs.verifiers_env import check_task, read_task_shard  # noqa: E402

ARITH = {
    "dataset": "basic_arithmetic",
    "options": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+", "-"]},
    "size": 16,
    "seed": 3,
    "instruction": "{question} Reply with only the number.",
    "answer_from": "last_number",
}


def arith_rows(size=4, start=0, rank=0, world_size=1):
    return read_task_shard("vf-reasoning-gym", ARITH, start, size, rank, world_size)


def items():
    return reasoning_gym.create_dataset("basic_arithmetic", size=16, seed=3, **ARITH["options"])


def test_single_turn_rows_are_the_tasks_prompts():
    rows, reference = arith_rows(size=6, start=2), items()
    assert [r.index for r in rows] == list(range(2, 8))
    for row in rows:
        question = reference[row.index]["question"]
        assert row.messages == [{"role": "user", "content": f"{question} Reply with only the number."}]
        assert row.data_source == "verifiers/vf-reasoning-gym" and row.answer is None
    assert [r.index for r in arith_rows(size=6, start=2, rank=1, world_size=2)] == [3, 5, 7]


class Answerer:
    """A model that writes "It is N<|im_end|>" with N = `answer`, log-prob -0.25 a token; `cut` returns the reply
    without its end and finish "length"."""

    def __init__(self, answer: int, cut: bool = False):
        self.answer, self.cut, self.calls = answer, cut, []

    def __call__(self, prompt_ids, max_tokens, seed):
        self.calls.append(list(prompt_ids))
        ids = CODEC.encode(f"It is {self.answer}") + ([] if self.cut else [END])
        return ids, [-0.25] * len(ids), "length" if self.cut else "stop"


def test_the_loop_answers_once_and_the_task_scores_the_reply():
    loop = EnvironmentLoop(AgentConfig(kind="verifiers", max_turns=4, max_trajectory_tokens=4096), {}, CODEC)
    reference = items()
    for row in arith_rows(size=4):
        entry, prompt = reference[row.index], row.prompt_ids(TOK)
        score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
        for offset, cut in [(0, False), (1, False), (0, True)]:
            model = Answerer(int(entry["answer"]) + offset, cut)
            t = loop.run(prompt, model, 32, seed=5, row=row)
            assert len(model.calls) == t.num_turns == 1 and model.calls[0] == prompt  # one reply: the stop fired
            assert t.reward == score(str(int(entry["answer"]) + offset), entry) == (1.0 if offset == 0 else 0.0)
            assert t.response_ids == CODEC.encode(f"It is {model.answer}") + ([] if cut else [END])
            assert set(t.response_mask) == {1} and set(t.rollout_logprobs) == {-0.25}
            assert t.ended_by == "environment" and t.finish_reason == ("length" if cut else "stop")
            assert t.scores == {"reward/correct": t.reward, "metric/has_answer": 1.0}


class Data(vf.TaskData):
    turns: int


class Counting(vf.Task[Data]):
    """A task in verifiers' own form: a @stop after `turns` replies, a weighted @reward and a @metric over the
    trace's messages."""

    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= self.data.turns

    @vf.reward(weight=0.5)
    async def replies(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))

    @vf.metric
    async def yeses(self, trace: vf.Trace) -> float:
        return float(sum(m.content == "yes" for m in trace.assistant_messages))


class Seat(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime={"type": "subprocess"})


class Again:
    """An environment (verifiers' Env surface: config, setup, run) that answers every reply with "again" until
    the exchange ends, then records a reward of its own."""

    def __init__(self):
        self.config = Seat(taskset={"id": "vf-reasoning-gym", "dataset": "basic_arithmetic"})

    async def setup(self, agents):
        pass

    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                segment = await interaction.turn("again")
        interaction.trace.record_reward("env", 1.0, 2.0)


def test_the_trace_holds_the_exchange_and_the_tasks_functions_score_it():
    heard, replies = [], iter(["yes", "no", "yes", "no"])

    def play(message):
        heard.append(message)
        return next(replies)

    trace = run_episode(Again(), Counting(Data(prompt="go", system_prompt="be brief", turns=3)), play)
    assert heard == [None, "again", "again"]  # the @stop fired before a fourth reply
    assert [(m.role, m.content) for m in trace.messages] == [
        ("system", "be brief"),
        ("user", "go"),
        ("assistant", "yes"),
        ("user", "again"),
        ("assistant", "no"),
        ("user", "again"),
        ("assistant", "yes"),
        ("user", "again"),
    ]
    assert trace.stop_condition == "enough" and trace.num_turns == 3
    assert trace.rewards["replies"].value == 1.5 and trace.rewards["env"].value == 2.0
    assert trace.reward == 3.5 and trace.metrics == {"yeses": 2.0}
    # what metrics log of it: each reward's unweighted score and each metric
    assert named_scores(trace) == {"reward/replies": 3.0, "reward/env": 1.0, "metric/yeses": 2.0}

    # the loop's cap ends it first: the task still scores the partial exchange
    capped = run_episode(Again(), Counting(Data(prompt="go", turns=3)), lambda m: None if m else "yes")
    assert capped.stop_condition == CAPPED and capped.num_turns == 1 and capped.reward == 0.5 + 2.0


def test_what_the_in_process_route_cannot_run_is_refused():
    class Prepares(Counting):
        async def setup(self, trace, runtime):
            pass

    class NeedsRuntime(Counting):
        @vf.reward
        async def files(self, trace: vf.Trace, runtime) -> float:
            return 0.0

    class ReadsRequests(Counting):
        @vf.stop
        async def too_long(self, request: vf.Request) -> bool:
            return False

    data = Data(prompt="go", turns=1)
    check_task(Counting(data))  # scored from the trace alone: played
    cases = [
        (Prepares(data), "needs a runtime \\(setup hook\\)"),
        (Counting(data.model_copy(update={"image": "python:3.12"})), "needs a runtime \\(container\\)"),
        (Counting(data, vf.TaskConfig.model_validate({"judges": [{"id": "reference"}]})), "judges, which call"),
        (NeedsRuntime(data), "files score"),
        (ReadsRequests(data), "too_long read"),
    ]
    for task, message in cases:
        with pytest.raises(ValueError, match=message):
            check_task(task)
