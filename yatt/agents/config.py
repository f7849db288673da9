"""`AgentConfig`: the `rollout.agent` section (which loop, its limits, the tools it offers and their sections).

```yaml
rollout:
  agent:
    kind: tool_loop                 # single_turn | tool_loop | my_pkg.loops:MyLoop
    max_turns: 4
    max_trajectory_tokens: 1024
    tools:
      calculator: {}                # kind defaults to the name: the built-in calculator
      python: {timeout_s: 10}
      weather: {kind: my_pkg.tools:Weather, units: metric}
```

Like every section, it forbids unknown keys, and each tool's section is validated against that tool's own
`config` class (`yatt.tools.base.ToolConfig`); a plug-in loop that declares a `config` class gets `options`
validated against it. Validation imports the plug-ins it names, as every registry check does, and reads no
other file: whether the python tool's sandbox can run here is found on its first call.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, SerializeAsAny, field_validator, model_validator

from yatt.agents import AGENT_LOOPS
from yatt.tools import TOOLS
from yatt.tools.base import ToolConfig


def _tool_section(value: Any) -> ToolConfig:
    """A tool's section as its own config class (its `kind` filled in from its name by `AgentConfig`)."""
    if isinstance(value, ToolConfig):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        raise ValueError("a tool's section is a mapping of its settings, e.g. {timeout_s: 5}")
    entry = TOOLS.get(value["kind"])
    config = getattr(entry, "config", None)
    if not (isinstance(config, type) and issubclass(config, ToolConfig)):
        raise ValueError(
            f"tool {value['kind']!r} has no `config` section class (a subclass of yatt.tools.base.ToolConfig)"
        )
    return config.model_validate(value)


ToolSection = Annotated[SerializeAsAny[ToolConfig], PlainValidator(_tool_section)]


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = Field(
        "single_turn",
        description="The agent loop, a name in yatt.agents.AGENT_LOOPS: single_turn (one generate call per "
        "sample, no tools), tool_loop (model turns and tool calls in the Qwen2.5/Hermes format), verifiers (a "
        "verifiers environment package plays its task with the model; rows of a data source of kind verifiers; "
        "docs/environments.md), or an import path 'pkg.module:Loop' (yatt.agents.base.AgentLoop).",
    )
    max_turns: int = Field(
        4,
        gt=0,
        description="Model turns per trajectory at most (tool_loop, verifiers: e.g. 6 for Wordle's six guesses); "
        "each is at most rollout.max_new_tokens.",
    )
    max_trajectory_tokens: int = Field(
        2048,
        gt=0,
        description="Cap on a trajectory's prompt + response ids, all turns and tool responses included "
        "(tool_loop, verifiers); the engine's max_model_len must allow it.",
    )
    tools: dict[str, ToolSection] = Field(
        default_factory=dict,
        description="The tools offered, by the name the model calls: {name: its section}; the section's kind "
        "(default: the name) is a name in yatt.tools.TOOLS (calculator, python) or an import path "
        "'pkg.module:Tool'.",
    )
    lockstep: bool = Field(
        False,
        description="Turns go to the engines in rounds: a round's turns (every live conversation's next one) in "
        "one call, sent once the last of them is ready. Which turns share an engine batch then never depends on "
        "thread timing, so a run on hf engines reproduces itself and resumes exactly after a crash; the price is "
        "that no conversation's tool call overlaps another's generation. false: each turn is sent as soon as it "
        "is ready.",
    )
    options: Any = Field(
        None,
        description="A plug-in loop's own settings, validated against the `config` class its entry declares; "
        "a loop without one takes none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, value: Any) -> Any:
        """`rollout.agent=single_turn` is the section with that kind and its defaults."""
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        return AGENT_LOOPS.check(kind)

    @field_validator("tools", mode="before")
    @classmethod
    def _kind_from_name(cls, tools: Any) -> Any:
        """`calculator: {}` (or null) means `calculator: {kind: calculator}`, and `c: calculator` means `c: {kind:
        calculator}`; an unknown kind is an error naming the tool's own field."""
        if not isinstance(tools, dict):
            return tools
        sections = {}
        for name, section in tools.items():
            if isinstance(section, str):  # `c: calculator`, a bare kind
                section = {"kind": section}
            if section is None or isinstance(section, dict):
                section = {"kind": name, **(section or {})}
                if isinstance(section["kind"], str):
                    TOOLS.check(section["kind"], f"rollout.agent.tools.{name}.kind")
            sections[name] = section
        return sections

    @model_validator(mode="after")
    def _combinations(self) -> AgentConfig:
        if self.kind in ("single_turn", "verifiers") and self.tools:
            raise ValueError(f"rollout.agent.tools is set but kind is {self.kind}, which calls no tools")
        if self.kind == "tool_loop" and not self.tools:
            raise ValueError("rollout.agent.kind=tool_loop needs at least one tool in rollout.agent.tools")
        config = getattr(AGENT_LOOPS.get(self.kind), "config", None)
        if config is None and self.options is not None:
            raise ValueError(f"rollout.agent.options is set but loop {self.kind!r} declares no `config` class")
        if config is not None and not isinstance(self.options, config):
            self.options = config.model_validate(self.options or {})
        return self
