"""What an agent loop is: the callables it drives (`Generate`, `Codec`), what it returns (`Trajectory`), and its
signature (`AgentLoop`), stated once.

Token in, token out: a loop receives the prompt as ids and builds the response by appending ids, the model's as
the engine sampled them and the environment's (tool responses) tokenized alone. The history is never decoded
and re-encoded, because that can change the ids (a different split of the same text), and then the trainer
would score tokens the engine never sampled and the PPO ratio would be wrong.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from yatt.tools.base import Tool


class Generate(Protocol):
    """One model turn: continue `prompt_ids` (the whole history so far) by at most `max_tokens` tokens.

    Returns (token ids, their log-probs under the sampling distribution, one per id, "stop" | "length"), as
    `yatt.engines.base.Completion` has them; the stop token, when one ended the turn, is the last id. The same
    seed gives the same turn. Called from the loop's thread; a driver running many loops at once in threads
    must make it thread-safe."""

    def __call__(self, prompt_ids: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float], str]: ...


class Codec(Protocol):
    """The tokenizer as a loop uses it: text the environment adds becomes ids alone (no BOS or other tokens
    added), and a model turn's ids become text to parse."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class TokenizerCodec:
    """A Hugging Face tokenizer as a `Codec`. Special tokens written in the text (``<|im_start|>``) become their
    ids, as the chat template's own tokenization does."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass
class Trajectory:
    """One conversation, ready to become a rollout.

    `response_ids` is every id after the prompt, model turns and environment turns in order; `response_mask[i]`
    is 1 where the model sampled `response_ids[i]` (trained on) and 0 where the environment added it (tool
    responses, turn headers: in the context, never in the loss); `rollout_logprobs[i]` is the engine's log-prob
    of a model token and 0.0 at masked positions. The three lists have one entry per response id.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    # "stop": the model finished (a turn without a tool call); "length": cut short (a turn's max_tokens, the token
    # cap, or max_turns while still calling tools) — the values Rollout.finish_reason already takes
    finish_reason: str = "stop"
    # why it ended, for metrics: "no_tool_call", "turn_length", "token_cap", "max_turns"
    ended_by: str = "no_tool_call"
    num_turns: int = 0  # model turns (generate calls)
    # well-formed calls the model wrote (unknown tools and failed calls included); all were run except those of a
    # last turn cut by max_turns
    tool_calls: int = 0
    malformed_tool_calls: int = 0  # <tool_call> blocks that did not parse (not executed; the model reads why)
    tool_errors: int = 0  # well-formed calls whose result had an error
    text: str = ""  # the whole response decoded without special tokens (tool responses included)
    final_text: str = ""  # the last model turn decoded without special tokens: what a verifier usually scores
    # an MoE engine's routing of every prompt and response id (routing replay r3): set by the conversation pool
    # from the last turn's forward (yatt.controllers.conversations), not by the loop
    routed_experts: list[list[int]] = field(default_factory=list)
    # the environment's own score of the whole trajectory (an environment loop sets it, e.g. a game's reward:
    # yatt.agents.environment); None: the rule verifier or judges score `final_text`
    reward: float | None = None
    # the environment's named scores of it, for metrics (e.g. a verifiers trace's `reward/<name>`, `metric/<name>`:
    # yatt.envs.episode.named_scores), logged as their means over samples; empty: none
    scores: dict[str, float] = field(default_factory=dict)

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Add a model turn (`logprobs` given, mask 1) or environment tokens (None: mask 0, log-prob 0.0)."""
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"a model turn of {len(ids)} ids came with {len(logprobs)} log-probs")
        self.response_ids += ids
        self.response_mask += [1 if logprobs is not None else 0] * len(ids)
        self.rollout_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class AgentLoop(Protocol):
    """A conversation policy between the model and its environment. An `AGENT_LOOPS` entry is a class built once
    per run as ``Loop(cfg, tools, codec)`` (`cfg`: the `rollout.agent` section, `yatt.agents.config.AgentConfig`;
    `tools`: name -> built tool, `yatt.tools.toolbox.build_tools`), then `run` once per sample, possibly from
    several threads at once (keep per-conversation state in `run`).

    `one_call` (optional, default False): `run` is exactly one generate call whose result is the trajectory, every
    token the model's (single_turn). Such a loop's samples go to the engines as they are, a prompt's G samples in
    one request the engines batch and seed (yatt.controllers.conversations.Agent.pool), without a thread and a
    call per sample.

    `takes_row` (optional, default False): `run` is called with `row=`, the prompt's `yatt.data.rows.PromptRow`,
    for a loop whose environment depends on the task and not only on the prompt's ids (an environment package's
    task, in the row's metadata: yatt.agents.environment)."""

    one_call: bool

    def __init__(self, cfg: Any, tools: dict[str, Tool], codec: Codec) -> None: ...

    def run(self, prompt_ids: list[int], generate: Generate, max_new_tokens: int, seed: int) -> Trajectory:
        """One trajectory from the prompt's ids. `max_new_tokens` bounds each model turn (rollout.max_new_tokens);
        `seed` the sample's seed, the first turn's (`turn_seed` for the others)."""
        ...


def row_kwargs(loop: AgentLoop, row: Any) -> dict[str, Any]:
    """What `run` gets besides its ids: the prompt's row, for a loop that takes it (AgentLoop.takes_row)."""
    return {"row": row} if getattr(loop, "takes_row", False) else {}


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a conversation's turn: the sample's own for the first turn (so single_turn samples exactly what
    a plain generate call would), then a hash of (seed, turn) so no two turns or samples share a stream."""
    return seed if turn == 0 else zlib.crc32(f"{seed}:{turn}".encode()) & 0x7FFFFFFF


def replay(
    loop: AgentLoop, prompt_ids: list[int], turns: list[list[int]], max_new_tokens: int, row: Any = None
) -> Trajectory:
    """The trajectory `loop` builds when the model writes exactly `turns` (each ending with its stop token), tools
    run and environment text added by the loop itself. This is how a warm-up (SFT) of an agent gets its examples:
    teacher forcing through the run's own loop, so they hold the ids, tool responses and mask a rollout of the
    run would. Raises ValueError when the loop does not take the turns as given (asks for another turn, ends
    before the last one, or allows a turn fewer tokens than it has). `row`: the prompt's row, for a loop that
    takes it (AgentLoop.takes_row: an environment's task)."""
    used = 0

    def generate(history: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float], str]:
        nonlocal used
        if used == len(turns):
            raise ValueError(
                f"the loop asks for model turn {used + 1} but there are {len(turns)} (does the last one call a tool?)"
            )
        turn = turns[used]
        if len(turn) > max_tokens:
            raise ValueError(
                f"model turn {used + 1} has {len(turn)} tokens, more than the {max_tokens} the loop "
                "allows it (max_new_tokens, max_trajectory_tokens)"
            )
        used += 1
        return list(turn), [0.0] * len(turn), "stop"

    trajectory = loop.run(list(prompt_ids), generate, max_new_tokens, 0, **row_kwargs(loop, row))
    if used != len(turns):
        raise ValueError(f"the loop ended after model turn {used} of {len(turns)} (turn {used} calls no tool?)")
    return trajectory
