"""Named components the config chooses between: one `Registry` kind for every pluggable set.

Trainer backends, rollout engines, advantage estimators, policy losses, KL estimators, verifiers,
partitioners and file readers each live in a registry that maps a name to its implementation, given as
``"module:attribute"`` so that reading a config (which checks the name) never imports torch, vLLM or megatron.
Adding one is one new file and one `register` line (or one entry in the registry's table).

Code outside yatt plugs in without editing it, two ways:
- by import path in the YAML: any value a registry checks may be ``"my_pkg.module:attr"`` itself
  (e.g. ``trainer.backend: my_pkg.trainer:MyTrainer``); the module is imported when the config is checked
  (verifiers, named by the data, when the run reads its data: yatt.rewards.rules);
- by calling ``REGISTRY.register("name", "my_pkg.module:attr")`` (or with the object) before the config loads.

Every registry, with the config key that selects from it (docs/extending.md): trainer.backend (TRAINERS),
rollout.engine.backend (ENGINES), algorithm.advantage.kind (ADVANTAGES), algorithm.policy_loss.kind
(POLICY_LOSSES), algorithm.kl_estimator (KL_ESTIMATORS), algorithm.loss_agg (LOSS_AGGREGATIONS),
balance.partitioner (PARTITIONERS), a row's data_source (yatt.rewards.rules.RULES; reward.verifiers adds to it),
data.<split>.kind (yatt.data.sources.FILE_READERS), rollout.agent.kind (yatt.agents.AGENT_LOOPS),
rollout.agent.tools.<name>.kind (yatt.tools.TOOLS), rollout.engine.weight_transport
(yatt.transport.weights.WEIGHT_TRANSPORTS; registered names only: the engine process must know it too).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# a Python import path and an attribute: "pkg.module:attr"
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_path(name: str) -> bool:
    return bool(_IMPORT_PATH.match(name))


def load_object(path: str) -> Any:
    """The object at ``"pkg.module:attr"`` (attr may be dotted). Errors name the path and what is missing."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {err}") from None
    except Exception as err:  # the module itself fails (a syntax error, an exception at import): one line too
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {type(err).__name__}: {err}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj


class Registry:
    def __init__(self, field: str, entries: dict[str, Any] | None = None):
        self.field = field  # the config key that selects an entry, for error messages
        self._entries: dict[str, Any] = dict(entries or {})  # name -> "module:attr" or the object itself

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries or is_import_path(name)

    def __iter__(self):
        return iter(self.names())

    def check(self, name: str, field: str | None = None) -> str:
        """`name` if registered, or if it is an import path that loads (imported now, so that a bad path is an
        error of the config that names it); else a ValueError listing the registered names. `field`: the config
        key to name instead of the registry's own (e.g. critic.loss_agg)."""
        if name in self._entries:
            return name
        if not is_import_path(name):
            raise ValueError(
                f"unknown {field or self.field} {name!r}; registered: {', '.join(self.names())} "
                "(or an import path 'package.module:attr')"
            )
        self._load(name, field)
        return name

    def get(self, name: str, field: str | None = None) -> Any:
        """The implementation of `name`, importing it on first use (an import path loads directly)."""
        target = self._entries[name] if name in self._entries else self.check(name, field)
        return self._load(target, field) if isinstance(target, str) else target

    def _load(self, path: str, field: str | None) -> Any:
        try:
            return load_object(path)
        except ValueError as err:  # one line naming the field and the path
            raise ValueError(f"{field or self.field}: {err}") from None

    def register(self, name: str, target: Any) -> None:
        """Add an entry: `target` is ``"module:attr"`` (imported on first use) or the object itself."""
        if isinstance(target, str) and not is_import_path(target):
            raise ValueError(f"{self.field}: register({name!r}, {target!r}): expected 'package.module:attr'")
        self._entries[name] = target
