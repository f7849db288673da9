"""The import graph of yatt/ obeys the layering rules of docs/architecture.md (read with ast: nothing is imported).

Every `import yatt.x` / `from yatt.x import ...` counts, at module level or inside a function, because a lazy
import is still a dependency. A rule names a package and the packages it must never import.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "yatt"

LOWER = ("algorithms", "balance", "checkpoint", "data", "engines", "transport", "models", "rewards", "agents", "tools")
LOWER += ("envs",)  # environment packages (yatt.envs): read by the data sources and agent loops
HIGHER = ("controllers", "trainers", "placement", "genrm", "quickstart")
# package -> what it must not import (a rule from docs/architecture.md, with its reason)
RULES = {
    **{
        low: (HIGHER + ("config",), "lower layers know no controller, trainer, placement, judge or experiment config")
        for low in LOWER
    },
    "tensors": (LOWER + HIGHER + ("config",), "the shared types import no other yatt module"),
    "distributed": (LOWER + HIGHER + ("config",), "the process-group wrapper imports no other yatt module"),
    "registry": (LOWER + HIGHER + ("config",), "the registry imports no other yatt module"),
    "tools": (HIGHER + ("agents", "engines"), "a tool knows no agent loop, engine, controller or trainer"),
    "trainers": (
        ("controllers", "placement", "genrm", "engines", "config"),
        "a trainer knows no controller and no engine, and reads its own section (trainer), not the experiment",
    ),
    "backends": (LOWER + HIGHER + ("config",), "a backend choice is names and import paths, loaded when chosen"),
    "preflight": (
        ("controllers", "trainers", "placement", "engines"),
        "the checks before any rank starts read the config and its files; they build no component",
    ),
    "launcher": (
        ("trainers", "placement", "engines", "genrm", "algorithms"),
        "the launcher checks the config and starts the run (yatt.controllers.run), not its parts",
    ),
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


def test_launch_scripts_stay_thin():
    """launch/train.py is the launcher's entry point and nothing else; no launch script builds a trainer or
    placement itself."""
    scripts = {path.name: imports_of(path) for path in (PACKAGE.parent / "launch").glob("*.py")}
    assert scripts["train.py"] == {"launcher"}
    assert {
        name: found & {"trainers", "placement"} for name, found in scripts.items() if found & {"trainers", "placement"}
    } == {}


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


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """yatt module -> the yatt modules it imports (lazy imports count; `if TYPE_CHECKING:` ones are types only)."""
    mods = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in mods.items():
        tree, deps = ast.parse(path.read_text()), set()
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    """An import circle makes the order modules load in matter and the layers meaningless."""
    assert cycles(module_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker sees one
