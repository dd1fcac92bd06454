"""The production guide's §8.1 check as the docs write it for a master with a cluster
secret: every such line in the README, the docs and the Compose file, run with bash
against a real master with a secret, finds the ``kv_cache`` and ``connected`` lines; the
guide's line without the token finds nothing there (the master answers 401)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.testing.processes import PoolProcess, start_master
from tests.deploy.doc_commands import DOCS, ROOT, bash, for_this_master, kvpool_on_path, shell_lines
from tests.master.auth_pool import secret_file

GREP = 'grep -E "kv_cache|connected"'
# every file that shows the check for a master with a secret, README to Compose
SHOWN_IN = [
    ROOT / "README.md",
    DOCS / "monitoring.md",
    DOCS / "operations.md",
    DOCS / "security.md",
    ROOT / "deploy" / "compose" / "docker-compose.yml",
]


@dataclass
class SecuredMaster:
    master: PoolProcess
    secret: Path
    env: dict[str, str]

    def run(self, doc_line: str) -> tuple[int, list[str]]:
        done = bash(for_this_master(doc_line, self.master.address, self.secret), self.env)
        assert not done.stderr, f"{doc_line}: {done.stderr}"
        return done.returncode, done.stdout.splitlines()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredMaster]:
    tmp = tmp_path_factory.mktemp("metrics-check")
    secret = secret_file(tmp)
    with start_master("--segment_size", "1MB", "--secret_file", str(secret)) as master:
        yield SecuredMaster(master, secret, kvpool_on_path(tmp / "bin"))


def with_token(path: Path, endpoint: str) -> list[str]:
    return [
        line
        for line in shell_lines(path)
        if line.startswith("curl") and "$(kvpool secret token" in line and endpoint in line
    ]


@pytest.mark.parametrize("path", SHOWN_IN, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_documented_check_with_the_token_finds_both_lines(
    secured: SecuredMaster, path: Path
) -> None:
    lines = [line for line in with_token(path, ":50088/metrics") if line.endswith(GREP)]
    assert lines, f"{path.name} shows no §8.1 check with the operator's token"
    for line in lines:
        status, found = secured.run(line)
        assert status == 0, f"{line}: the grep found nothing"
        assert any(f.startswith("kvpool_kv_cache_blocks_total ") for f in found), found
        assert any(f.startswith("kvpool_connected_clients ") for f in found), found


def test_the_guides_line_as_written_finds_nothing_on_a_master_with_a_secret(
    secured: SecuredMaster,
) -> None:
    (line,) = [
        line
        for line in shell_lines(DOCS / "operations.md")
        if line.startswith("curl -s http://") and line.endswith(GREP)
    ]
    status, found = secured.run(line)
    assert (status, found) == (1, [])  # grep's "no line matched"
    code_of = line.split("|")[0] + " -o /dev/null -w '%{http_code}'"
    assert secured.run(code_of) == (0, ["401"])


def test_the_documented_status_query_with_the_token_reads_the_pool(
    secured: SecuredMaster,
) -> None:
    (line,) = with_token(DOCS / "security.md", ":50088/api/status")
    status, found = secured.run(line)
    assert status == 0
    assert json.loads("\n".join(found))["objects"] == 0


def test_the_readmes_token_check_is_its_marked_block() -> None:
    # README.md's block is held to the docs' coverage test by its marker
    from tests.docs.blocks import doc_block

    (line,) = with_token(ROOT / "README.md", ":50088/metrics")
    assert doc_block("readme.metrics-token").commands() == [line]
