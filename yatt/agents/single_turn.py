"""The single-turn loop: one generate call per sample, every response token the model's (yatt without tools)."""

from __future__ import annotations

from typing import Any

from yatt.agents.base import Codec, Generate, Trajectory
from yatt.tools.base import Tool


class SingleTurn:
    one_call = True  # the engines' own request of G samples is this loop (yatt.agents.base.AgentLoop)

    def __init__(self, cfg: Any, tools: dict[str, Tool], codec: Codec):
        self.codec = codec

    def run(self, prompt_ids: list[int], generate: Generate, max_new_tokens: int, seed: int) -> Trajectory:
        ids, logprobs, finish = generate(list(prompt_ids), max_new_tokens, seed)
        trajectory = Trajectory(
            prompt_ids=list(prompt_ids),
            finish_reason=finish,
            ended_by="no_tool_call" if finish == "stop" else "turn_length",
            num_turns=1,
        )
        trajectory.append(ids, logprobs)
        trajectory.text = trajectory.final_text = self.codec.decode(ids, skip_special_tokens=True)
        return trajectory
