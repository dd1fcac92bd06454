"""The parts of kvpool and the arrows between them, enforced.

The intended layering is written once, in ``docs/architecture.md`` (the table under "Parts
and arrows"); this test reads that table, builds kvpool's import graph with ``ast`` (every
import, including those inside functions, which is where optional dependencies hide) and
fails on any arrow the table does not allow, on a forbidden third-party import, and on an
import cycle between modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpool"
DOC = ROOT / "docs" / "architecture.md"


def _table() -> dict[str, tuple[set[str], set[str]]]:
    """part → (parts it may import, third-party modules it must not import)."""
    text = DOC.read_text()
    section = text.split("## Parts and arrows", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        names = lambda cell: set(re.findall(r"`([\w.]+)`", cell))  # noqa: E731
        rows[cells[0].strip("`")] = (names(cells[2]), names(cells[3]))
    return rows


RULES = _table()


def _part(module: str) -> str:
    """``kvpool.client.client`` → ``client``; the package's own ``__init__`` is ``kvpool``."""
    pieces = module.split(".")
    if len(pieces) == 1:
        return "kvpool"
    return pieces[1]


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(module: str, path: Path, *, top_level_only: bool = False) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target
            for alias in node.names:  # ``from kvpool.x import y`` may import module x.y
                yield f"{target}.{alias.name}"


MODULES = dict(_modules())


def _resolve(name: str) -> str | None:
    """The kvpool module an import names (longest known prefix), or None if external."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def test_the_table_names_every_part() -> None:
    parts = {_part(m) for m in MODULES}
    assert parts <= set(RULES), f"parts missing from docs/architecture.md: {parts - set(RULES)}"
    for part, (allowed, _) in RULES.items():
        assert allowed <= set(RULES) | {"*"}, f"{part}: unknown parts {allowed - set(RULES)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_arrows(module: str) -> None:
    part = _part(module)
    allowed, banned = RULES[part]
    wrong = []
    for name in set(_imports(module, MODULES[module])):
        target = _resolve(name)
        if target is None:
            top = name.split(".")[0]
            if top in banned or name in banned:
                wrong.append(f"{name} (third-party, forbidden in {part})")
            continue
        other = _part(target)
        if other != part and other not in allowed and "*" not in allowed:
            wrong.append(f"{target} ({part} → {other})")
    assert not wrong, f"{module} imports: " + ", ".join(sorted(set(wrong)))


def _top_level_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_resolve(n) for n in _imports(module, path, top_level_only=True)}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def test_no_import_cycles() -> None:
    graph = _top_level_graph()
    # a package's __init__ importing its own modules is how packages work, not a cycle
    for module in graph:
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" → ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _part(m) != "connectors"))
def test_only_the_connectors_import_vllm(module: str) -> None:
    # stated on its own, whatever the table says: vLLM is an optional extra
    names = {n.split(".")[0] for n in _imports(module, MODULES[module])}
    assert "vllm" not in names, f"{module} imports vLLM"
