"""The tool loop: the model writes a turn, its tool calls run, their results come back as a user turn, repeat.

One conversation, as `run` builds it (Qwen2.5 / Hermes format, `yatt.tools.hermes`):

    prompt ids (chat template, tools in the system prompt, ending with the assistant header)
    model turn 1      ...<tool_call>{...}</tool_call><|im_end|>          mask 1, engine log-probs
    environment       \\n<|im_start|>user\\n<tool_response>...<|im_end|>\\n<|im_start|>assistant\\n   mask 0
    model turn 2      ... the answer<|im_end|>                            mask 1
It ends at the first of: a turn with no ``<tool_call>`` (finish "stop"), a turn cut by its max_tokens, the token
cap (prompt + response ids, `max_trajectory_tokens`: a turn gets at most what is left, and a tool response that
would not leave room for one more model token is not added), or `max_turns` model turns while the model still
calls tools (the last turn's calls are not run). The last three finish with "length".

Each turn is generated from the exact ids so far; the environment's text is tokenized alone and appended.
"""

from __future__ import annotations

from yatt.agents.base import Codec, Generate, Trajectory, turn_seed
from yatt.agents.config import AgentConfig
from yatt.tools.base import Tool
from yatt.tools.hermes import TURN_END, MalformedCall, ParsedCalls, parse_tool_calls, tool_response_text
from yatt.tools.toolbox import call_tool


class ToolLoop:
    def __init__(self, cfg: AgentConfig, tools: dict[str, Tool], codec: Codec):
        self.cfg, self.tools, self.codec = cfg, tools, codec

    def run(self, prompt_ids: list[int], generate: Generate, max_new_tokens: int, seed: int) -> Trajectory:
        cap = self.cfg.max_trajectory_tokens
        trajectory = Trajectory(prompt_ids=list(prompt_ids))
        last_turn: list[int] = []
        for turn in range(self.cfg.max_turns):
            room = cap - trajectory.num_tokens
            if room <= 0:
                self._end(trajectory, "length", "token_cap")
                break
            history = trajectory.prompt_ids + trajectory.response_ids
            ids, logprobs, finish = generate(history, min(max_new_tokens, room), turn_seed(seed, turn))
            trajectory.append(ids, logprobs)
            trajectory.num_turns += 1
            last_turn = ids
            if finish != "stop":
                self._end(trajectory, "length", "token_cap" if room < max_new_tokens else "turn_length")
                break
            text = self.codec.decode(ids)
            parsed = parse_tool_calls(text)
            trajectory.tool_calls += len(parsed.calls)
            trajectory.malformed_tool_calls += len(parsed.malformed)
            if not parsed.items:
                self._end(trajectory, "stop", "no_tool_call")
                break
            if turn == self.cfg.max_turns - 1:
                self._end(trajectory, "length", "max_turns")
                break
            outputs = self._call_tools(parsed, trajectory)
            environment = self.codec.encode(tool_response_text(outputs, turn_ended=text.endswith(TURN_END)))
            if trajectory.num_tokens + len(environment) >= cap:  # no room left for the model to read it and answer
                self._end(trajectory, "length", "token_cap")
                break
            trajectory.append(environment, None)
        trajectory.text = self.codec.decode(trajectory.response_ids, skip_special_tokens=True)
        trajectory.final_text = self.codec.decode(last_turn, skip_special_tokens=True)
        return trajectory

    def _call_tools(self, parsed: ParsedCalls, trajectory: Trajectory) -> list[str]:
        """One output per call, in the order written; a malformed call is answered with why it did not parse."""
        outputs = []
        for item in parsed.items:
            if isinstance(item, MalformedCall):
                outputs.append(f"malformed tool call: {item.reason}")
                continue
            result = call_tool(self.tools, item)
            trajectory.tool_errors += not result.ok
            outputs.append(result.output)
        return outputs

    @staticmethod
    def _end(trajectory: Trajectory, finish_reason: str, ended_by: str) -> None:
        trajectory.finish_reason, trajectory.ended_by = finish_reason, ended_by
