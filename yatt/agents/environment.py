"""The environment loop (`rollout.agent.kind: verifiers`): a verifiers environment package plays its own
protocol with the model, in-process, token in and token out, and its own reward is the sample's.

One conversation, as `run` builds it (a row of a `kind: verifiers` data source, yatt.envs.verifiers_env):

    prompt ids (the task's system prompt and opening message through the chat template, assistant header)
    model turn 1    ...My guess is [crane]<|im_end|>                                     mask 1, engine log-probs
    environment     \\n<|im_start|>user\\nC R A N E ...<|im_end|>\\n<|im_start|>assistant\\n     mask 0
    model turn 2    ...                                                                mask 1
The environment's `run` (e.g. TextArena's game loop) drives the exchange through yatt.envs.episode: each user
turn it sends is rendered as the chat template renders a user turn after the model's reply (`ChatTurns`),
tokenized alone and appended under mask 0; each model turn is generated from the exact ids so far and handed to
the environment as text. A single-turn environment (verifiers' SingleAgentEnv) is one model turn. It ends when
the environment ends it (the game is over, the task's @stop fired, the one reply was given: ended_by
"environment", finish "stop", or "length" if that last turn ran out of tokens) or the loop does: `max_turns` model
turns, or the token cap (`max_trajectory_tokens`; finish "length"), after which the environment sees a terminated
turn and records its outcome. The trajectory's `reward` is the episode trace's (what the task's @reward functions
and the environment recorded, summed), which yatt.rewards.rules.score_rollout takes as the sample's rule score;
its `scores` are the trace's named rewards and metrics, logged as `env/...` (yatt.controllers.metrics).
"""

from __future__ import annotations

from typing import Any

from yatt.agents.base import Codec, Generate, Trajectory, turn_seed
from yatt.agents.config import AgentConfig
from yatt.data.rows import PromptRow
from yatt.tools.base import Tool

_REPLY, _USER = "\x00reply\x00", "\x00user\x00"  # markers that no template writes


class ChatTurns:
    """How the tokenizer's chat template writes a user turn after a model reply, found by rendering a probe
    conversation with and without one more user turn: what follows a reply (`after_reply`, e.g.
    ``<|im_end|>\\n``) and what surrounds the user's text up to the next assistant header (`head`, `tail`)."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "rollout.agent.kind=verifiers renders the environment's turns with the policy's chat "
                "template, and its tokenizer has none (use an instruct model)"
            )
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _REPLY}]
        closed = tokenizer.apply_chat_template(probe, tokenize=False)
        opened = tokenizer.apply_chat_template(
            probe + [{"role": "user", "content": _USER}], tokenize=False, add_generation_prompt=True
        )
        if not opened.startswith(closed) or closed.count(_REPLY) != 1 or opened.count(_USER) != 1:
            raise ValueError(
                "the chat template does not render a conversation as its earlier turns followed by "
                "the new one, so the environment's turns cannot be appended to the model's ids"
            )
        self.tokenizer = tokenizer
        self.after_reply = closed[closed.index(_REPLY) + len(_REPLY) :]
        self.head, self.tail = opened[len(closed) :].split(_USER)

    def user_turn(self, content: str, reply_ids: list[int]) -> str:
        """The text after a model turn of `reply_ids` up to the next assistant header: the reply's close (less
        the stop token the model wrote itself, e.g. ``<|im_end|>``), the user turn, the assistant header."""
        close = self.after_reply
        if reply_ids and reply_ids[-1] in self.tokenizer.all_special_ids:
            stop = self.tokenizer.decode(reply_ids[-1:])
            close = close.removeprefix(stop) if close.startswith(stop) else close
        return close + self.head + content + self.tail


class EnvironmentLoop:
    takes_row = True  # the task is in the row (yatt.agents.base.AgentLoop)

    def __init__(self, cfg: AgentConfig, tools: dict[str, Tool], codec: Codec):
        tokenizer = getattr(codec, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("rollout.agent.kind=verifiers needs the policy's tokenizer (a TokenizerCodec)")
        self.cfg, self.codec, self.turns = cfg, codec, ChatTurns(tokenizer)

    def run(
        self, prompt_ids: list[int], generate: Generate, max_new_tokens: int, seed: int, row: PromptRow | None = None
    ) -> Trajectory:
        from yatt.envs.episode import named_scores, run_episode
        from yatt.envs.verifiers_env import task_of

        env, task = task_of(row)
        cap, max_turns = self.cfg.max_trajectory_tokens, self.cfg.max_turns
        trajectory = Trajectory(prompt_ids=list(prompt_ids), ended_by="environment")
        last: list[int] = []
        last_finish = "stop"  # the last model turn's: "length" when it ran out of tokens

        def end(ended_by: str) -> None:
            trajectory.finish_reason, trajectory.ended_by = "length", ended_by

        def play(message: str | None) -> str | None:
            nonlocal last, last_finish
            if trajectory.num_turns == max_turns:
                end("max_turns")
                return None
            if message is not None:
                environment = self.codec.encode(self.turns.user_turn(message, last))
                if trajectory.num_tokens + len(environment) >= cap:  # no room for the model to answer it
                    end("token_cap")
                    return None
                trajectory.append(environment, None)
            room = cap - trajectory.num_tokens
            if room <= 0:
                end("token_cap")
                return None
            history = trajectory.prompt_ids + trajectory.response_ids
            ids, logprobs, last_finish = generate(
                history, min(max_new_tokens, room), turn_seed(seed, trajectory.num_turns)
            )
            trajectory.append(ids, logprobs)
            trajectory.num_turns += 1
            last = ids
            return self.codec.decode(ids, skip_special_tokens=True)

        trace = run_episode(env, task, play)
        trajectory.reward, trajectory.scores = trace.reward, named_scores(trace)
        if last_finish == "length" and trajectory.ended_by == "environment":  # ended on an unfinished reply
            trajectory.finish_reason = "length"
        trajectory.text = self.codec.decode(trajectory.response_ids, skip_special_tokens=True)
        trajectory.final_text = self.codec.decode(last, skip_special_tokens=True)
        return trajectory
