"""Tool calls in the Qwen2.5 / Hermes chat format: parsing the model's calls, writing the tool-response turn.

The format is the one Qwen2.5-Instruct's chat template (tokenizer_config.json) renders, itself the Hermes
function-calling convention:
- the system prompt lists the tools inside ``<tools></tools>`` (give `tool_schema`s as `tools=` to
  `apply_chat_template`);
- the assistant calls a tool with ``<tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>``,
  several calls in one turn being several such blocks, and ends its turn with ``<|im_end|>``;
- the results come back in one user turn, one ``<tool_response>`` block per call, in call order:
  ``<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>\\n<tool_response>...</tool_response><|im_end|>\\n``,
  followed by the next assistant header ``<|im_start|>assistant\\n``.

`tool_response_text` writes exactly what the template puts after an assistant turn that ended at
``<|im_end|>``, so that a trajectory built turn by turn matches the template's rendering of the same
conversation, while its ids are never re-tokenized (`yatt.agents.tool_loop`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TURN_END = "<|im_end|>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    text: str  # the block as the model wrote it (or the stray tag and what follows)
    reason: str  # one line, shown to the model in the tool response


@dataclass
class ParsedCalls:
    """The calls of one model turn in the order written, well-formed (`ToolCall`) or not (`MalformedCall`: not
    executed, answered with its reason, counted for the fraction of well-formed calls)."""

    items: list[ToolCall | MalformedCall] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def malformed(self) -> list[MalformedCall]:
        return [item for item in self.items if isinstance(item, MalformedCall)]


def parse_tool_calls(text: str) -> ParsedCalls:
    """Every ``<tool_call>...</tool_call>`` block in `text`. A block is well formed when its body is a JSON object
    with a non-empty string "name" and an object "arguments" (other keys are ignored). A ``<tool_call>`` never
    closed, or a ``</tool_call>`` never opened, is one malformed call. Text outside the blocks is ignored."""
    parsed = ParsedCalls()
    position = 0
    for match in _BLOCK.finditer(text):
        _stray_closes(text[position : match.start()], parsed)
        call = _parse_block(match.group(1))
        parsed.items.append(call if isinstance(call, ToolCall) else MalformedCall(match.group(0), call))
        position = match.end()
    rest = text[position:]
    opened = rest.find(OPEN)
    _stray_closes(rest if opened < 0 else rest[:opened], parsed)
    if opened >= 0:
        parsed.items.append(MalformedCall(rest[opened:], f"{OPEN} without {CLOSE}"))
    return parsed


def _stray_closes(between: str, parsed: ParsedCalls) -> None:
    for _ in range(between.count(CLOSE)):
        parsed.items.append(MalformedCall(CLOSE, f"{CLOSE} without {OPEN}"))


def _parse_block(body: str) -> ToolCall | str:
    """The call in one block's body, or why it is malformed."""
    try:
        value = json.loads(body)
    except ValueError as err:
        return f"not JSON ({err.msg} at character {err.pos})"
    if not isinstance(value, dict):
        return f"expected a JSON object, got {type(value).__name__}"
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not name:
        return 'missing "name" (a non-empty string)'
    if not isinstance(arguments, dict):
        return 'missing "arguments" (a JSON object)'
    return ToolCall(name=name, arguments=arguments)


def tool_response_text(outputs: list[str], turn_ended: bool = True) -> str:
    """The environment's text after a model turn that called tools: the tool-response user turn (one block per
    output, in call order) and the next assistant header. `turn_ended`: the model's turn already ends with
    ``<|im_end|>``; else it is closed here (e.g. a turn that stopped at another stop token)."""
    blocks = "".join(f"\n<tool_response>\n{output}\n</tool_response>" for output in outputs)
    close = "" if turn_ended else TURN_END
    return f"{close}\n<|im_start|>user{blocks}{TURN_END}\n<|im_start|>assistant\n"
