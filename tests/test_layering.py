"""The import graph of yatt/ obeys the layering rules of docs/architecture.md (read with ast: nothing is imported).

Every `import yatt.x` / `from yatt.x import ...` counts, at module level or inside a function, because a lazy
import is still a dependency. A rule names a package and the packages it must never import.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "yatt"

LOWER = ("algorithms", "balance", "checkpoint", "data", "engines", "transport", "models", "rewards", "agents", "tools")
HIGHER = ("controllers", "trainers", "placement", "genrm", "quickstart")
# package -> what it must not import (a rule from docs/architecture.md, with its reason)
RULES = {
    **{low: (HIGHER, "lower layers know no controller, trainer, placement or judge") for low in LOWER},
    "tensors": (LOWER + HIGHER + ("config",), "the shared types import no other yatt module"),
    "distributed": (LOWER + HIGHER + ("config",), "the process-group wrapper imports no other yatt module"),
    "registry": (LOWER + HIGHER + ("config",), "the registry imports no other yatt module"),
    "tools": (HIGHER + ("agents", "engines"), "a tool knows no agent loop, engine, controller or trainer"),
    "trainers": (("controllers", "placement", "genrm", "engines"), "a trainer knows no controller and no engine"),
    "genrm": (("controllers", "placement", "trainers"), "judging knows no controller, placement or trainer"),
    "placement": (("controllers", "trainers"), "placement drives engines and roles, not the controller"),
}


def imports_of(path: Path) -> set[str]:
    """The yatt subpackages (first component after yatt.) a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "yatt"]
        for name in names:
            parts = name.split(".")
            if parts[0] == "yatt" and len(parts) > 1:
                found.add(parts[1])
    return found


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = layer_of(path)
        forbidden, reason = RULES.get(layer, ((), ""))
        for target in sorted(imports_of(path) & set(forbidden)):
            out.append(f"{path.relative_to(PACKAGE.parent)} imports yatt.{target}: {reason}")
    return out


def test_layering_rules_hold():
    assert violations() == []


def test_rules_name_real_packages():
    """A rule about a package that does not exist would pass forever."""
    layers = {layer_of(p) for p in PACKAGE.rglob("*.py")}
    for layer, (forbidden, _) in RULES.items():
        assert layer in layers, layer
        assert set(forbidden) <= layers | {"config"}, (layer, set(forbidden) - layers)


def test_checker_sees_lazy_imports(tmp_path, monkeypatch):
    """A function-level import counts (the checker is not fooled by laziness)."""
    fake = tmp_path / "yatt"
    (fake / "balance").mkdir(parents=True)
    (fake / "balance" / "bad.py").write_text("def f():\n    from yatt.controllers.shard import ControllerShard\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert violations() == ["yatt/balance/bad.py imports yatt.controllers: " + RULES["balance"][1]]


if __name__ == "__main__":
    pytest.main([__file__])
