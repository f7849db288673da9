"""What a tool is: a name the model calls, a JSON-schema description for the chat template, and `call`.

A tool never raises to its caller for anything the model did (bad arguments, hostile code, a timeout): it
returns a `ToolResult` whose `error` says what went wrong in one line, so a bad call costs one turn, not the
run. `yatt.tools.toolbox.call_tool` adds a last guard for plug-in tools that raise anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class ToolResult:
    """What one call returned.

    `output` is what the model reads in the tool-response turn: it states the error too when there is one.
    `error` is None when the call did what was asked, else a one-line summary that starts with the tool's
    kind ("python: killed after 5.0 s wall clock"), for metrics and logs.
    """

    output: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, error: str, output: str = "") -> ToolResult:
        """A failed call whose output is `output` followed by the error line (unless it already ends with it)."""
        body = output.rstrip("\n")
        if not body.endswith(error):
            body = f"{body}\n{error}" if body else error
        return cls(output=body, error=error)


class ToolConfig(BaseModel):
    """Base of every tool's config section (`rollout.agent.tools.<name>`); `kind` names its `TOOLS` entry and
    defaults to the name the section is under. Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")
    kind: str


class Tool(Protocol):
    """A tool as an agent loop calls it. Built as ``Entry(cfg)`` from its own section; the name the model uses
    is the key of that section, so one implementation can be offered twice under two names."""

    config: ClassVar[type[ToolConfig]]  # its section class (a subclass of ToolConfig)
    description: str  # one or two sentences the model reads in the system prompt
    parameters: dict[str, Any]  # JSON schema of `arguments` (an object), as chat templates expect

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run once with the model's arguments (already a dict, not yet checked against `parameters`)."""
        ...


def tool_schema(name: str, tool: Tool) -> dict[str, Any]:
    """The entry of `tools=[...]` that `tokenizer.apply_chat_template` renders into the system prompt
    (OpenAI function format, which the Qwen2.5 and Hermes templates read)."""
    return {
        "type": "function",
        "function": {"name": name, "description": tool.description, "parameters": tool.parameters},
    }


def string_argument(arguments: dict[str, Any], key: str, tool: str) -> str | ToolResult:
    """`arguments[key]` when it is a string, else the failed result to return (the model sees why)."""
    value = arguments.get(key)
    if isinstance(value, str):
        return value
    if value is None:
        return ToolResult.failed(f"{tool}: missing argument {key!r} (a string)")
    return ToolResult.failed(f"{tool}: argument {key!r} must be a string, got {type(value).__name__}")
