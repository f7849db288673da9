"""Agent loops: how one sample's conversation between the model and its tools unfolds, token in, token out.

Read in this order: `base.py` (the signature of a loop, `Trajectory`, and the `Generate` and `Codec` callables it
drives), `config.py` (`AgentConfig`, the `rollout.agent` section), then the loops: `single_turn.py` (one
generate call: yatt's behaviour without tools) and `tool_loop.py` (model turn, tool calls, tool responses, until
the model stops calling tools or a limit is hit) and `environment.py` (an environment package, e.g. a verifiers
TextArena game, plays its own protocol with the model in-process; its reward is the sample's).

`AGENT_LOOPS` names the loops `rollout.agent.kind` chooses between; a user's loop plugs in by import path,
``kind: my_pkg.loops:MyLoop`` (docs/extending.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from yatt.registry import Registry

if TYPE_CHECKING:
    from yatt.agents.base import AgentLoop, Codec
    from yatt.agents.config import AgentConfig

AGENT_LOOPS: Registry = Registry(
    "rollout.agent.kind",
    {
        "single_turn": "yatt.agents.single_turn:SingleTurn",
        "tool_loop": "yatt.agents.tool_loop:ToolLoop",
        "verifiers": "yatt.agents.environment:EnvironmentLoop",
    },
)


def build_loop(cfg: AgentConfig, codec: Codec) -> AgentLoop:
    """The configured loop with its tools built (once per run; `run` once per sample)."""
    from yatt.tools.toolbox import build_tools

    return AGENT_LOOPS.get(cfg.kind)(cfg, build_tools(cfg.tools), codec)


__all__ = ["AGENT_LOOPS", "build_loop"]
