"""A plug-in tool, as a user writes one outside yatt: one file, offered from the config by its import path,
`rollout.agent.tools: {reverse: {kind: tests.plugins.my_tool:Reverse, upper: true}}`, and built from its own
typed section (`ReverseConfig`). It reverses a string."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from yatt.tools.base import ToolConfig, ToolResult, string_argument


class ReverseConfig(ToolConfig):
    # `kind` stays ToolConfig's str: it holds the import path the config names this tool by
    upper: bool = Field(False, description="Also upper-case the result.")


class Reverse:
    config: ClassVar[type[ToolConfig]] = ReverseConfig
    description = "Reverse a string."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }

    def __init__(self, cfg: ReverseConfig):
        self.cfg = cfg

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        text = string_argument(arguments, "text", "reverse")
        if isinstance(text, ToolResult):
            return text
        out = text[::-1]
        return ToolResult(output=out.upper() if self.cfg.upper else out)
