"""Named components the config chooses between: trainer backends, rollout engines, algorithm parts.

A registry maps a name to its implementation, given as ``"module:attribute"`` so that reading a config
(which checks the name) never imports torch, vLLM or megatron. Adding a backend is one new file and one
line in its registry; the config's allowed values are the registry's names.
"""

from __future__ import annotations

import importlib
from typing import Any


class Registry:
    def __init__(self, field: str, entries: dict[str, str]):
        self.field = field  # the config key that selects an entry, for error messages
        self._entries = dict(entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def check(self, name: str) -> str:
        """`name` if registered; else a ValueError listing the registered names (a config error)."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.field} {name!r}; registered: {', '.join(self.names())}")
        return name

    def get(self, name: str) -> Any:
        module, _, attr = self._entries[self.check(name)].partition(":")
        return getattr(importlib.import_module(module), attr)

    def register(self, name: str, target: str) -> None:
        """Add an entry at run time (a plug-in outside yatt, or a test's fake)."""
        self._entries[name] = target
