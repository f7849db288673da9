"""A plug-in agent loop, as a user writes one outside yatt: one file, chosen by its import path,
`rollout.agent: {kind: tests.plugins.my_agent_loop:AskTwice, options: {nudge: ...}}`, with its own typed settings
(`AskTwiceConfig`, validated from `options`). The model answers, is asked whether it is sure, and answers again;
the question is the environment's (mask 0), both answers the model's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from yatt.agents.base import Codec, Generate, Trajectory, turn_seed
from yatt.tools.base import Tool


class AskTwiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nudge: str = Field("\nSure?\n", description="What the environment says between the two answers.")


class AskTwice:
    config = AskTwiceConfig

    def __init__(self, cfg: Any, tools: dict[str, Tool], codec: Codec):
        self.options: AskTwiceConfig = cfg.options
        self.codec = codec

    def run(self, prompt_ids: list[int], generate: Generate, max_new_tokens: int, seed: int) -> Trajectory:
        trajectory = Trajectory(prompt_ids=list(prompt_ids))
        for turn in range(2):
            if turn:
                trajectory.append(self.codec.encode(self.options.nudge), None)
            history = trajectory.prompt_ids + trajectory.response_ids
            ids, logprobs, finish = generate(history, max_new_tokens, turn_seed(seed, turn))
            trajectory.append(ids, logprobs)
            trajectory.num_turns += 1
            trajectory.finish_reason = finish
        trajectory.final_text = self.codec.decode(ids, skip_special_tokens=True)
        trajectory.text = self.codec.decode(trajectory.response_ids, skip_special_tokens=True)
        return trajectory
