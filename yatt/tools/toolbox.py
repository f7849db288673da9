"""The tools of one agent loop, built from their sections, and the one place a call is made.

`call_tool` is the guard between the model and the tools: an unknown name, or a plug-in tool that raises,
becomes a failed `ToolResult` the model reads, so no call a model writes can end a run.
"""

from __future__ import annotations

from typing import Any

from yatt.tools import TOOLS
from yatt.tools.base import Tool, ToolConfig, ToolResult, tool_schema
from yatt.tools.hermes import ToolCall


def build_tools(sections: dict[str, ToolConfig]) -> dict[str, Tool]:
    """name the model calls -> the tool built from its section (`rollout.agent.tools`)."""
    return {
        name: TOOLS.get(section.kind, f"rollout.agent.tools.{name}.kind")(section) for name, section in sections.items()
    }


def tool_schemas(tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """`tools=` for `apply_chat_template`, in the configured order."""
    return [tool_schema(name, tool) for name, tool in tools.items()]


def call_tool(tools: dict[str, Tool], call: ToolCall) -> ToolResult:
    """The result of one call; never raises for anything the call or the tool did (KeyboardInterrupt and
    SystemExit still stop the process)."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult.failed(f"unknown tool {call.name!r}; available: {', '.join(tools) or 'none'}")
    try:
        result = tool.call(call.arguments)
    except Exception as err:  # a plug-in's bug is the call's error, not the run's
        return ToolResult.failed(f"{call.name}: {type(err).__name__}: {err}".splitlines()[0])
    if not isinstance(result, ToolResult):
        return ToolResult.failed(f"{call.name}: returned {type(result).__name__}, not a ToolResult")
    return result
