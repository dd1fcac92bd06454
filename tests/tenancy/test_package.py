"""kvpool.tenancy's own shape, which the layering table cannot say for one module: its
book of namespaces and quotas is pure (no I/O, no clock, nothing of kvpool), and the
master's tenant layer reaches the master only through the seam it declares."""

from __future__ import annotations

from pathlib import Path

from tests.imports import imports_of, under

PACKAGE = Path(__file__).resolve().parents[2] / "kvpool" / "tenancy"
NO_IO = {"socket", "ssl", "asyncio", "threading", "subprocess", "os", "pathlib", "time"}
NO_IO |= {"logging", "select", "selectors", "mmap", "urllib", "prometheus_client"}


def _imports(name: str) -> set[str]:
    return imports_of(PACKAGE / f"{name}.py")


def test_the_book_is_pure() -> None:
    io = sorted(m for m in _imports("book") if under(m, NO_IO))
    assert not io, f"kvpool.tenancy.book imports {io}"
    inside = sorted(m for m in _imports("book") if m.startswith("kvpool"))
    assert not inside, f"kvpool.tenancy.book imports {inside}"


def test_no_module_of_it_reads_the_master() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        above = {m for m in _imports(path.stem) if under(m, {"kvpool.master", "kvpool.node"})}
        assert not above, f"{path.name} imports {sorted(above)}"
