"""Tools an agent loop offers the model, and the format their calls take in the text.

Read in this order: `base.py` (what a tool is: `Tool`, `ToolResult`, `ToolConfig`), `toolbox.py` (building the
configured tools, calling one without ever raising), `hermes.py` (parsing ``<tool_call>`` blocks, writing the
``<tool_response>`` turn), then the built-in tools: `calculator.py`, and `python.py` with the process sandbox it
runs code in (`sandbox.py`, and `sandbox_child.py`, which runs inside the sandboxed interpreter).

`TOOLS` names the tools a config may offer (`rollout.agent.tools.<name>.kind`, defaulting to <name>): an entry
is a class built from its own section (`Entry(cfg)`, cfg an instance of `Entry.config`); a user's tool plugs in
by import path, ``kind: my_pkg.tools:Weather`` (docs/extending.md).
"""

from yatt.registry import Registry

TOOLS: Registry = Registry(
    "rollout.agent.tools.<name>.kind",
    {"calculator": "yatt.tools.calculator:Calculator", "python": "yatt.tools.python:PythonTool"},
)

__all__ = ["TOOLS"]
