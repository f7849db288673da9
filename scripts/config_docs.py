"""Write docs/config.md, the reference of every config field, from the pydantic models in yatt.config.

    python scripts/config_docs.py            # rewrite docs/config.md
    python scripts/config_docs.py --check    # exit 1 if docs/config.md is stale (tests/test_config_docs.py)

Each section is a table of its fields (key, type, default, description); a field whose value is one of several
sections (an algorithm part chosen by `kind`, a data source) lists each choice as its own table. The page is
generated: edit the `Field(description=...)` in the code, then rerun this script.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from types import NoneType, UnionType

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from yatt.backends import BackendChoice  # noqa: E402
from yatt.config import ExperimentConfig  # noqa: E402
from yatt.refusals import REFUSALS  # noqa: E402

OUT = ROOT / "docs" / "config.md"
HEADER = """# Config reference

Generated from the pydantic models by `python scripts/config_docs.py`; do not edit by hand
(`tests/test_config_docs.py` fails when this page is stale). A run's YAML sets these keys; `key.sub=value`
arguments of `launch/train.py` override them. Unknown keys are errors.
"""


def _strip(tp):
    """The type without Annotated metadata."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _models(tp) -> list[type[BaseModel]]:
    """The section classes a field holds: itself, its union's choices, or a list's items."""
    tp = _strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    if typing.get_origin(tp) in (typing.Union, UnionType, list, dict):
        args = typing.get_args(tp)[-1:] if typing.get_origin(tp) is dict else typing.get_args(tp)
        return [m for a in args for m in _models(a)]
    return []


def _type_name(tp) -> str:
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", "") for a in typing.get_args(tp))
    if origin in (typing.Union, UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if tp is NoneType:
        return "null"
    return getattr(tp, "__name__", str(tp))


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    value = field.default
    return "null" if value is None else f"`{value}`"


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def render_section(model: type[BaseModel], key: str, out: list[str], seen: dict[type, str]) -> None:
    """`model`'s table under `key`, then its nested sections'; a class already documented is a pointer."""
    if model in seen:
        out += ["", f"## `{key}`", "", f"Same fields as `{seen[model]}`."]
        return
    seen[model] = key
    doc = _one_line(model.__doc__) if model.__doc__ and model.__module__ != "pydantic.main" else ""
    out += ["", f"## `{key}`" + (f" ({model.__name__})" if "[" in key or "kind=" in key else ""), ""]
    if doc:
        out += [doc, ""]
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        if (field.json_schema_extra or {}).get("hidden"):  # a test's fault injection, not a user's setting
            continue
        models = _models(field.annotation)
        out.append(
            f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {_one_line(field.description)} |"
        )
        for sub in models:
            kind = sub.model_fields.get("kind")
            suffix = ""
            if len(models) > 1 and kind is not None:
                kinds = _type_name(kind.annotation).replace(" \\| ", "/")
                kinds = "package.module:attr" if kinds == "str" else kinds  # a plug-in by import path
                suffix = f" (kind={kinds})"
            is_list = typing.get_origin(_strip(field.annotation)) is list
            nested.append((sub, f"{key}.{name}{'[]' if is_list else ''}{suffix}"))
    if issubclass(model, BackendChoice):  # each backend's own section, beside `backend` (yatt.backends)
        for name in model.backends.names():
            entry = model.backends.get(name)
            if getattr(entry, "section", None):
                nested.append((entry.config, f"{key}.{entry.section} (backend={name} only)"))
    for sub, sub_key in nested:
        render_section(sub, sub_key, out, seen)


def render() -> str:
    out = [HEADER.rstrip()]
    seen: dict[type, str] = {}
    for name, field in ExperimentConfig.model_fields.items():
        for sub in _models(field.annotation):
            render_section(sub, name, out, seen)
    render_refusals(out)
    return "\n".join(out) + "\n"


def render_refusals(out: list[str]) -> None:
    """The table of yatt.refusals: every combination yatt refuses, and when it is found."""
    out += ["", "## Refused combinations", "",
            "Every combination yatt refuses (`yatt/refusals.py`), found before any rank starts: at validation, or, "
            "where it needs the ranks launched or a model folder's config.json, by the launcher's checks "
            "(`yatt/preflight.py`). The error is one line naming the fields.", "",
            "| settings | why | found |", "|---|---|---|"]  # fmt: skip
    for r in REFUSALS:
        when = "launch (ranks, model folder)" if r.launch else "validation"
        out.append(f"| {_one_line(r.fields).replace('|', '/')} | {_one_line(r.why)} | {when} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
