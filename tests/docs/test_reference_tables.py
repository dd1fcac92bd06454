"""The docs' reference tables name exactly what the code has: a key, flag or variable
added in code without its row (or a row left for one removed) fails here."""

from __future__ import annotations

import re
from pathlib import Path

from kvpool.config.kv_transfer import STORE_EXTRA_KEYS, TRANSFER_EXTRA_KEYS
from kvpool.config.master import MASTER_FLAGS
from kvpool.config.node import NODE_KEYS
from tests.docs.blocks import ROOT

_CODE = re.compile(r"`([^`]+)`")


def table_under(doc: str, heading: str, *, line_with: str = "") -> list[list[str]]:
    """The rows (cells, without the header and rule) of the first table after
    ``heading`` in ``doc`` (after its first line holding ``line_with``, if given)."""
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and heading in line)
    if line_with:
        start = next(i for i in range(start, len(lines)) if line_with in lines[i])
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"{doc}: no table under {heading!r}"
    return rows[2:]


def names(cell: str) -> list[str]:
    """The names a first cell lists: its code spans (`a` / `b`, `c`)."""
    return _CODE.findall(cell)


def test_the_master_flag_table_is_master_config_with_its_defaults() -> None:
    rows = table_under("docs/configuration.md", "`kvpool master` flags")
    documented = {names(row[0])[0]: row[1].strip("`") for row in rows}
    code = {f"--{flag.name}": _default(flag.default, flag.shown_default) for flag in MASTER_FLAGS}
    assert set(documented) == set(code)
    assert documented == code


def _default(value: object, shown: str) -> str:
    return '""' if value == "" else shown


def test_the_node_config_table_is_node_keys() -> None:
    rows = table_under("docs/configuration.md", "The node config file")
    assert {names(row[0])[0] for row in rows} == set(NODE_KEYS)


def test_the_connector_tables_are_their_parsers_keys() -> None:
    store = table_under("docs/connectors.md", "Settings reference")
    assert {n for row in store for n in names(row[0])} == set(STORE_EXTRA_KEYS)
    transfer = table_under(
        "docs/connectors.md", "Settings reference", line_with="Keys of the transfer connector's"
    )
    assert {n for row in transfer for n in names(row[0])} == set(TRANSFER_EXTRA_KEYS)


# read by tests and benchmarks only, or set by kvpool for its own children: not an
# operator's setting
_INTERNAL = {
    "KVPOOL_HOST_NETNS": "bench/ and kvpool.testing mark the namespace a child runs in",
    "KVPOOL_ERROR": "the wire code of KVPoolError (kvpool/errors.py), not a variable",
    "KVPOOL_CONNECTORS": "a constant's name in kvpool.ops.kvconfig, not a variable",
}


def product_variables() -> set[str]:
    """Every ``"KVPOOL_..."`` literal in the product (a prefix such as KVPOOL_TLS_, whose
    names are spelled out elsewhere, is not one)."""
    found: set[str] = set()
    for path in (ROOT / "kvpool").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        found |= set(re.findall(r'"(KVPOOL_[A-Z0-9_]*[A-Z0-9])"', text))
    return found


def test_the_environment_table_lists_every_variable_the_product_reads() -> None:
    rows = table_under("docs/configuration.md", "Environment variables")
    documented = {n for row in rows for n in names(row[0])}
    missing = product_variables() - set(_INTERNAL) - documented
    assert not missing, f"variables the product reads that configuration.md lacks: {missing}"
    stale = {n for n in documented if n.startswith("KVPOOL_")} - product_variables()
    assert not stale, f"documented variables nothing reads: {stale}"


def test_the_internal_list_names_only_real_variables() -> None:
    assert set(_INTERNAL) <= product_variables()
    for name in _INTERNAL:  # and the reason above is true: not in an operator doc
        for doc in Path(ROOT / "docs").glob("*.md"):
            assert name not in doc.read_text(encoding="utf-8"), (name, doc.name)


_FAMILIES = "config|connector|env|input|keys|master|ports|security|ssd|timeouts"
# a check name in prose: not part of a module path (kvpool.config.fabrics) or a file name
_CHECK = re.compile(rf"(?<![\w./])(?:{_FAMILIES})\.(?!md\b|py\b|sh\b|json\b)[a-z_]+\b")
_CHECK_LITERAL = re.compile(rf'"((?:{_FAMILIES})\.[a-z_]+)')
_FILES = {"config.json", "env.sh", "master.sh", "mooncake.json", "node.cred"}  # not checks


def doctor_checks() -> set[str]:
    """Every check name in kvpool/ops/doctor (the names its checks are made with)."""
    found: set[str] = set()
    for path in (ROOT / "kvpool" / "ops" / "doctor").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        found |= {m.group(1) for m in _CHECK_LITERAL.finditer(text)}
    return found - _FILES


def test_the_docs_name_every_doctor_check_and_no_other() -> None:
    text = "".join((ROOT / f"docs/{d}.md").read_text(encoding="utf-8")
                   for d in ("operations", "mooncake"))  # fmt: skip
    documented = {m.group(0) for m in _CHECK.finditer(text)} - _FILES
    checks = doctor_checks()
    assert checks - documented == set(), "doctor checks the docs do not explain"
    assert documented - checks == set(), "documented checks doctor does not have"
