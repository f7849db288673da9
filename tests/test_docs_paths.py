"""Every file, link, make target and module that README.md and docs/ name exists.

Docs drift silently: a renamed script, a deleted config, a make target that was folded into another. This test
reads the markdown the way a user follows it: repository paths under the committed folders (globs such as
`scripts/gpu_check_*.py` must match something), relative links, `make <target>` and `python -m <module>`.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMITTED = ("launch", "configs", "scripts", "yatt", "tests", "benchmarks", "docs", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(map(re.escape, COMMITTED)) + r")/[\w.*/{},-]*[\w*}])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MAKE = re.compile(r"(?:^|`|\$ )make ([a-z][\w-]*)", re.M)  # a command, not the word
MODULE = re.compile(r"python -m (yatt[\w.]*)")


def named(pattern: re.Pattern, doc: Path) -> set[str]:
    return set(pattern.findall(doc.read_text()))


def expanded(path: str) -> list[str]:
    """`configs/quickstart_{rloo,ppo}.yaml` -> both names."""
    found = re.search(r"\{([^{}]*)\}", path)
    if not found:
        return [path]
    return [
        p for part in found.group(1).split(",") for p in expanded(path[: found.start()] + part + path[found.end() :])
    ]


def exists(path: str) -> bool:
    """A file or folder, a glob that matches, or an output prefix (`--out benchmarks/results/x` writes x.md)."""
    path = path.split(":")[0].rstrip(".")  # `yatt/x.py: Name` and a sentence's full stop
    return all(any(REPO.glob(p)) or any(REPO.glob(p + ".*")) for p in expanded(path))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_the_paths_a_doc_names_exist(doc):
    missing = sorted(p for p in named(PATH, doc) if not exists(p))
    assert not missing, f"{doc.relative_to(REPO)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_the_links_of_a_doc_resolve(doc):
    links = [link for link in named(LINK, doc) if not re.match(r"[a-z]+:", link)]  # not http:, mailto:
    missing = sorted(link for link in links if not (doc.parent / link).exists())
    assert not missing, f"{doc.relative_to(REPO)} links to files that do not exist: {missing}"


def test_the_make_targets_and_modules_the_docs_name_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    for doc in DOCS:
        assert not (named(MAKE, doc) - targets), f"{doc.name}: no such make target {named(MAKE, doc) - targets}"
        for module in named(MODULE, doc):
            assert importlib.util.find_spec(module.rstrip(".")) is not None, f"{doc.name}: no module {module}"
