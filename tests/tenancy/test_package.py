"""kvpool.tenancy's own shape, which the layering table cannot say for one module: its
book of namespaces and quotas is pure (no I/O, no clock, nothing of kvpool), and the
master's tenant layer reaches the master only through the seam it declares."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvpool" / "tenancy"
NO_IO = {"socket", "ssl", "asyncio", "threading", "subprocess", "os", "pathlib", "time"}
NO_IO |= {"logging", "select", "selectors", "mmap", "urllib", "prometheus_client"}


def _imports(name: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _under(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_book_is_pure() -> None:
    io = sorted(m for m in _imports("book") if _under(m, NO_IO))
    assert not io, f"kvpool.tenancy.book imports {io}"
    inside = sorted(m for m in _imports("book") if m.startswith("kvpool"))
    assert not inside, f"kvpool.tenancy.book imports {inside}"


def test_no_module_of_it_reads_the_master() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        above = {m for m in _imports(path.stem) if _under(m, {"kvpool.master", "kvpool.node"})}
        assert not above, f"{path.name} imports {sorted(above)}"
