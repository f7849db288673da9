"""Loading a pydantic config from YAML plus `a.b=c` overrides, with errors that name the file and field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

C = TypeVar("C", bound=BaseModel)


class Section(BaseModel):
    """A config section: an unknown key is an error naming it (a typo never passes silently)."""

    model_config = ConfigDict(extra="forbid")


class ConfigError(Exception):
    """A config that cannot be used; the message names the file and the field."""


def apply_override(tree: dict, assignment: str, source: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (so 3, 1e-4, true, [1,2] work)."""
    if "=" not in assignment:
        raise ConfigError(f"{source}: override {assignment!r} is not of the form key.sub=value")
    dotted, raw = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"{source}: override {assignment!r} has an empty key")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: override {dotted!r}: {key!r} is not a section")
        node = child
    try:
        node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: override {assignment!r}: value is not valid YAML ({err})") from None


def _override_of(loc: tuple, overrides: list[str]) -> str | None:
    """The command-line override that set the field at `loc` (or a section around or inside it), if any."""
    path = [str(p) for p in loc]
    for assignment in reversed(overrides):  # the last one of a key wins
        keys = assignment.split("=", 1)[0].strip().split(".")
        if path and (path[: len(keys)] == keys or keys[: len(path)] == path):
            return assignment
    return None


def format_validation_error(err: ValidationError, source: str, overrides: list[str] = ()) -> str:
    lines, from_file = [], False
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "the config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        shows_input = (
            e["loc"] and e["type"] not in ("extra_forbidden", "missing") and not isinstance(e.get("input"), dict)
        )
        got = f" (got {e.get('input')!r})" if shows_input else ""
        override = _override_of(e["loc"], list(overrides))
        from_file |= override is None
        lines.append(f"  {field}: {msg}{got}" + (f" [command line: {override}]" if override else ""))
    header = f"{source}: invalid config" if from_file else f"{source} with its command-line overrides: invalid config"
    return "\n".join([header, *lines])


def load_config(cls: type[C], path: str | Path | None, overrides: list[str] = ()) -> C:
    """Read `path` (YAML) into `cls`, after applying overrides; raise ConfigError naming file and field."""
    source = str(path) if path else "<defaults>"
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{source}: not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{source}: top level must be a mapping of sections")
    for assignment in overrides:
        apply_override(tree, assignment, f"{source} (command line)")
    try:
        return cls.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, overrides)) from None


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write the resolved config as YAML (paths and enums as plain strings)."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
