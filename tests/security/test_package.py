"""kvpool.security's own shape, which the layering table cannot say for one module: its
pure modules do no I/O, and no module of it reads datapath or config."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.imports import imports_of, under

PACKAGE = Path(__file__).resolve().parents[2] / "kvpool" / "security"
PURE = ("credentials", "handshake", "admission")
NO_IO = {"socket", "ssl", "asyncio", "threading", "subprocess", "os", "pathlib", "time"}
NO_IO |= {"logging", "select", "selectors", "kvpool.datapath", "kvpool.config"}


def _imports(name: str) -> set[str]:
    return imports_of(PACKAGE / f"{name}.py")


@pytest.mark.parametrize("name", PURE)
def test_the_pure_modules_do_no_io(name: str) -> None:
    io = sorted(m for m in _imports(name) if under(m, NO_IO))
    assert not io, f"kvpool.security.{name} imports {io}"
    inside = {m for m in _imports(name) if m.startswith("kvpool.")}
    allowed = {"kvpool.errors"} | {f"kvpool.security.{p}" for p in PURE}
    assert inside <= allowed, f"kvpool.security.{name} imports {sorted(inside - allowed)}"


def test_security_reads_neither_datapath_nor_config() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        above = {m for m in _imports(path.stem) if under(m, {"kvpool.datapath", "kvpool.config"})}
        assert not above, f"{path.name} imports {sorted(above)}"


def test_the_insecure_variable_is_named_alike_on_both_sides() -> None:
    # config and security read each other's modules in neither direction, so each names
    # the variable a connector's "insecure" comes from.
    from kvpool.config.values import ENV_INSECURE as CONFIG_SIDE
    from kvpool.security.secret import ENV_INSECURE

    assert CONFIG_SIDE == ENV_INSECURE == "KVPOOL_INSECURE"
