"""The docs' reference tables name exactly what the code has: a key, flag or variable
added in code without its row (or a row left for one removed) fails here."""

from __future__ import annotations

import os
import re
import socket
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
    "KVPOOL_TEST_RUN": "kvpool.testing.lifetime marks what a test run starts",
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
    rows = table_under("docs/configuration.md", "Environment variables")
    documented = {n for row in rows for n in names(row[0])}
    assert not set(_INTERNAL) & documented  # the reasons above say they are not settings


_FAMILIES = "config|connector|env|input|keys|master|ports|security|ssd|timeouts"
# a check name in prose: not part of a module path (kvpool.config.fabrics) or a file name
_CHECK = re.compile(rf"(?<![\w./])(?:{_FAMILIES})\.(?!md\b|py\b|sh\b|json\b)[a-z_]+\b")
_CHECK_LITERAL = re.compile(rf'"((?:{_FAMILIES})\.[a-z_]+)')
_FILES = {"config.json", "env.sh", "master.sh", "mooncake.json", "node.cred"}  # not checks


def doctor_checks() -> set[str]:
    """Every check name in kvpool/ops/doctor and kvpool/mooncake/doctor.py (the names its
    checks and Mooncake's findings are made with)."""
    found: set[str] = set()
    paths = [*(ROOT / "kvpool" / "ops" / "doctor").rglob("*.py")]
    for path in [*paths, ROOT / "kvpool" / "mooncake" / "doctor.py"]:
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


def test_the_error_class_table_is_the_hierarchy() -> None:
    import kvpool.errors as errors

    rows = table_under("docs/configuration.md", "Errors", line_with="<!-- errors: classes -->")
    documented = {names(row[0])[0]: names(row[1])[0] for row in rows}
    classes = {
        name: getattr(errors, name).code
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
    }
    assert documented == classes


def _busy_port() -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


# how to make each start-up line of configuration.md's table happen, by its first words
_TRIGGERS: dict[str, list[str]] = {
    "kvpool master: --port 50088:": ["master", "--port", "{busy}"],
    "kvpool master: --segment_size 100.0 TiB": ["master", "--port", "0", "--segment_size", "100TB"],
    "kvpool master: --host 0.0.0.0:": ["master", "--host", "0.0.0.0", "--port", "0"],
    "kvpool proxy: --host 0.0.0.0:": [
        "proxy",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--prefill",
        "http://a:1",
        "--decode",
        "http://b:2",
    ],
    "kvpool master: --eviction_ratio:": ["master", "--eviction_ratio", "3"],
    "kvpool master: --segment_size: unknown": ["master", "--segment_size", "4bananas"],
    "kvpool node: local_hostnme": ["node", "--config", "{bad_json}"],
    "kvpool node: KVPOOL_CONFIG_PATH=/x.json": ["node"],
}


def _pattern(line: str) -> re.Pattern[str]:
    """The doc's line as a pattern: numbers may differ (free space, ports), and ``...``
    stands for text the doc leaves out."""
    parts = [_numbers(re.escape(part)) for part in line.split("...")]
    return re.compile(".*".join(parts) + "$")


def _numbers(escaped: str) -> str:
    return re.sub(r"\d+(?:\\\.\d+)?", r"[\\d.]+", escaped)


def test_each_documented_start_up_error_is_the_products_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    rows = table_under("docs/configuration.md", "Errors", line_with="<!-- errors: start-up -->")
    assert {next(p for p in _TRIGGERS if names(row[0])[0].startswith(p)) for row in rows} == set(
        _TRIGGERS
    ), "a documented line without a trigger here, or a trigger without its line"
    (tmp_path / "bad.json").write_text('{"local_hostnme": "x"}')
    listener, busy = _busy_port()
    with listener:
        for row in rows:
            line = names(row[0])[0].replace("/tmp/bad.json", str(tmp_path / "bad.json"))
            prefix = next(p for p in _TRIGGERS if names(row[0])[0].startswith(p))
            argv = [a.format(busy=busy, bad_json=tmp_path / "bad.json") for a in _TRIGGERS[prefix]]
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
            env["KVPOOL_CONFIG_PATH"] = "/x.json"
            done = subprocess.run([sys.executable, "-m", "kvpool", *argv], env=env,
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            out = done.stderr.strip()
            assert done.returncode == 2 and len(out.splitlines()) == 1, (argv, done.stderr)
            assert _pattern(line.replace("50088", str(busy))).match(out), (line, out)
