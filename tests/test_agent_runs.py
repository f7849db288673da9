"""Agent loops in the run's machinery, without engines: many conversations driven at once through one pool
(`ConversationPool`, yatt.controllers.conversations), the rollouts they become, the loss mask the trainer reads
(yatt.controllers.policy.token_batch), and the config rules of rollout.agent."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from test_agents import CODEC, PROMPT, TURN_1, TURN_2, Scripted, tool_loop

from yatt.agents.base import Trajectory
from yatt.config import ExperimentConfig
from yatt.controllers.conversations import ConversationPool, agent_rollouts, conversation_seed
from yatt.controllers.generation import judged_text
from yatt.controllers.policy import token_batch
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow
from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.pool import Request
from yatt.genrm.config import JudgeConfig
from yatt.tools.hermes import tool_response_text

SAMPLING = SamplingSpec(n=4, temperature=1.0, max_tokens=200, logprobs=True)


class FakePool:
    """EnginePool's interface over a scripted model; records every request and how many were in flight at once."""

    def __init__(self, model):
        self.model, self.pending, self.sent, self.max_queue, self.peak = model, {}, [], 0, 0
        self.lock = threading.Lock()

    def in_flight(self) -> int:
        return len(self.pending)

    def submit(self, requests: list[Request]) -> None:
        assert threading.current_thread() is threading.main_thread()  # only the caller's thread touches the pool
        for r in requests:
            self.pending[r.key] = r
            self.sent.append(r)
        self.peak = max(self.peak, len(self.pending))

    def poll(self, max_wait_s: float = 0.02):
        out = []
        for key, r in list(self.pending.items()):
            ids, lps, finish = self.model(r.prompt, r.sampling.max_tokens, r.seed)
            out.append((key, [Completion(ids, lps, finish)]))
            del self.pending[key]
        return out

    def take_metrics(self, prefix: str) -> dict:
        return {}


def turn_model(prompt: list[int], max_tokens: int, seed: int):
    """Turn 1 calls the calculator, turn 2 answers; stateless, so conversations can share it."""
    turn = CODEC.encode(TURN_1 if prompt == PROMPT else TURN_2)
    return turn, [-0.5] * len(turn), "stop"


def test_conversations_run_at_once_and_equal_the_loop_run_alone():
    loop, pool = tool_loop(), FakePool(turn_model)
    conversations = ConversationPool(pool, loop)
    conversations.submit([Request(f"g{g}", PROMPT, 100 + g, SAMPLING) for g in range(3)])
    done = conversations.drain()
    assert sorted(done) == ["g0", "g1", "g2"] and all(len(t) == 4 for t in done.values())
    assert pool.peak >= 8  # the turns of many conversations were in flight together, not one by one
    assert all(r.sampling.n == 1 for r in pool.sent) and len(pool.sent) == 3 * 4 * 2
    for g, trajectories in done.items():
        for j, t in enumerate(trajectories):
            alone = loop.run(PROMPT, Scripted(CODEC, TURN_1, TURN_2), 200, conversation_seed(100 + int(g[1:]), j))
            assert (t.response_ids, t.response_mask, t.tool_calls) == (alone.response_ids, alone.response_mask, 1)
    first_turns = {r.seed for r in pool.sent if r.key.endswith("/t0")}
    assert len(first_turns) == 12  # every conversation has its own seed


class Recording(FakePool):
    """Also records the requests of each submit call: the turns an engine would batch together."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[list[str]] = []

    def submit(self, requests: list[Request]) -> None:
        self.calls.append([r.key for r in requests])
        super().submit(requests)


def test_lockstep_sends_each_round_of_turns_in_one_call_whatever_the_timing():
    """Conversations whose loop code takes a random while between turns: in lockstep every turn of a round goes
    in one call, in key order (without it, the calls follow the threads' timing)."""
    loop, pool = tool_loop(), Recording(turn_model)

    class Jittery:
        def run(self, prompt_ids, generate, max_new_tokens, seed):
            rng = random.Random(seed)

            def slow(*args):
                time.sleep(rng.uniform(0, 0.03))
                return generate(*args)

            return loop.run(prompt_ids, slow, max_new_tokens, seed)

    conversations = ConversationPool(pool, Jittery(), lockstep=True)
    conversations.submit([Request(f"g{g}", PROMPT, 100 + g, SAMPLING) for g in range(3)])
    assert sorted(conversations.drain(timeout_s=30)) == ["g0", "g1", "g2"]
    rounds = [sorted(f"g{g}/c{j}/t{t}" for g in range(3) for j in range(4)) for t in range(2)]
    assert pool.calls == rounds


def test_a_failing_loop_is_raised_in_the_callers_thread():
    class Broken:
        def run(self, prompt_ids, generate, max_new_tokens, seed):
            raise KeyError("boom")

    conversations = ConversationPool(FakePool(turn_model), Broken())
    conversations.submit([Request("g0", PROMPT, 1, SAMPLING)])
    with pytest.raises(RuntimeError, match="agent loop Broken failed on g0/.*boom"):
        conversations.drain(timeout_s=10)


def test_rollouts_and_the_loss_mask_by_token():
    t = tool_loop().run(PROMPT, Scripted(CODEC, TURN_1, TURN_2), 200, 0)
    row = PromptRow(index=0, prompt="q", messages=None, answer="69104", data_source="exact_match")
    [r] = agent_rollouts(row, PROMPT, [t])
    environment = CODEC.encode(tool_response_text(["69104"]))
    assert r.text == "69104" and r.agent_stats["tool_calls"] == 1.0
    batch = token_batch([r], pad_id=0, temperature=1.0)
    mask = batch.mask[0, len(PROMPT) - 1 :]
    n1 = len(CODEC.encode(TURN_1))
    assert mask.tolist() == [1.0] * n1 + [0.0] * len(environment) + [1.0] * len(CODEC.encode(TURN_2))
    scored = batch.extras["rollout_logprobs"][0, len(PROMPT) - 1 :]
    assert torch.equal(scored == 0, mask == 0)  # the engine's log-probs only under the mask
    with pytest.raises(ValueError, match="does not start with the prompt"):
        agent_rollouts(row, PROMPT[1:], [t])
    bad = Trajectory(PROMPT, [1, 2], [1], [0.0, 0.0])
    with pytest.raises(ValueError, match="2 response ids, 1 mask entries"):
        agent_rollouts(row, PROMPT, [bad])


def test_a_judge_reads_the_final_turn_or_the_whole_trajectory(tmp_path):
    """judges[].reads: final gives {response} the last model turn; trajectory the whole response, with the tool
    call, the tool's answer and the turn markers."""
    t = tool_loop().run(PROMPT, Scripted(CODEC, TURN_1, TURN_2), 200, 0)
    row = PromptRow(index=0, prompt="q", messages=None, answer="69104", data_source="exact_match")
    [r] = agent_rollouts(row, PROMPT, [t])
    judge = lambda reads: SimpleNamespace(cfg=JudgeConfig(model=tmp_path, template="{response}", reads=reads))  # noqa: E731
    assert judged_text(r, judge("final"), CODEC) == "69104"
    assert judged_text(r, judge("trajectory"), CODEC) == TURN_1 + tool_response_text(["69104"]) + TURN_2
    single = Rollout(row, PROMPT, CODEC.encode("42"), [0.0, 0.0], "stop", text="42")
    assert judged_text(single, judge("trajectory"), CODEC) == "42"  # a single-turn rollout: the same either way


def config(tmp_path, **rollout) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "model": {"path": str(tmp_path)},
            "data": {"train": {"kind": "jsonl", "files": ["t.jsonl"]}, "max_prompt_tokens": 16},
            "rollout": {"max_new_tokens": 8, **rollout},
        }
    )


def test_every_sample_goes_through_the_run_s_loop_and_one_call_loops_straight_to_the_engines():
    """One generation path: the run always has an Agent; single_turn (one_call) hands the engines' pool back
    untouched, so a prompt's G samples stay one batched request; a multi-turn loop runs conversations."""
    from yatt.agents import build_loop
    from yatt.agents.config import AgentConfig
    from yatt.controllers.conversations import Agent

    engines = FakePool(turn_model)
    single = Agent(build_loop(AgentConfig(), CODEC))
    assert not single.multi_turn and single.pool(engines) is engines
    conversing = Agent(build_loop(AgentConfig(kind="tool_loop", tools={"c": {"kind": "calculator"}}), CODEC))
    assert conversing.multi_turn and isinstance(conversing.pool(engines), ConversationPool)


def test_config_rules(tmp_path):
    single = config(tmp_path)
    assert single.rollout.agent.kind == "single_turn" and not single.rollout.multi_turn
    assert single.rollout_tokens == 24  # unchanged: prompt + one response
    agent = {"kind": "tool_loop", "tools": {"c": {"kind": "calculator"}}, "max_trajectory_tokens": 300}
    assert config(tmp_path, agent=agent).rollout_tokens == 300  # the engine's max_model_len default covers it
    with pytest.raises(ValidationError, match="max_trajectory_tokens = 300 exceeds rollout.engine.max_model_len=100"):
        config(tmp_path, agent=agent, engine={"max_model_len": 100})
    with pytest.raises(ValidationError, match="leaves no room for a response"):
        config(tmp_path, agent={**agent, "max_trajectory_tokens": 16})
    with pytest.raises(ValidationError, match="in_flight=resume is not implemented"):
        config(tmp_path, agent=agent, schedule={"mode": "one_step_off", "in_flight": "resume"})
    config(tmp_path, agent=agent, schedule={"mode": "one_step_off"})  # ahead, finishing in flight: composes


def test_a_tiny_folder_tokenizer_loads_as_written(tmp_path):
    """The tool format's newlines survive a tiny policy's folder (AutoTokenizer would rebuild it as a byte-level
    Qwen2Tokenizer and drop them, yatt.models.tokenizer)."""
    from yatt.models.tiny import TinyModelConfig, build_char_tokenizer, write_tiny_model
    from yatt.models.tokenizer import load_tokenizer

    alphabet, specials = "0123456789<>/_\nabcdefghijklmnopqrstuvwxyz", ["<|im_start|>", "<|im_end|>"]
    folder = write_tiny_model(tmp_path / "m", TinyModelConfig(alphabet=alphabet, special_tokens=specials))
    text = tool_response_text(["42"], turn_ended=False)
    built = build_char_tokenizer(alphabet, specials).encode(text, add_special_tokens=False)
    loaded = load_tokenizer(folder)
    assert loaded.encode(text, add_special_tokens=False) == built and loaded.decode(built) == text
