"""The python tool: runs the model's code in a sandboxed child interpreter (`yatt.tools.sandbox`).

The output is what the code printed (stdout and stderr interleaved, as a terminal shows them), plus the value
of a last bare expression; every failure (a limit, a refused action, an uncaught exception) is a one-line
error that starts with "python: ".
"""

from __future__ import annotations

from typing import Any, ClassVar

from yatt.tools.base import ToolConfig, ToolResult, string_argument
from yatt.tools.sandbox import PythonConfig, run_code


class PythonTool:
    """Runs ``{"code": "..."}``."""

    config: ClassVar[type[ToolConfig]] = PythonConfig
    description = (
        "Run Python 3 code (standard library only) and return what it prints; the value of a last bare "
        "expression is printed too. No network; files only in the current directory."
    )
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run"}},
        "required": ["code"],
    }

    def __init__(self, cfg: PythonConfig):
        self.cfg = cfg

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        code = string_argument(arguments, "code", "python")
        if isinstance(code, ToolResult):
            return code
        if len(code.encode("utf-8", "replace")) > self.cfg.max_code_bytes:
            return ToolResult.failed(f"python: code longer than {self.cfg.max_code_bytes} bytes")
        return run_code(code, self.cfg).result
