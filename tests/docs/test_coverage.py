"""Every command the operator docs tell a user to type is run by a test (tests/docs/blocks.py)."""

from __future__ import annotations

import re

from tests.docs.blocks import COMMAND_LANGS, CONFIG_LANGS, ROOT, all_blocks

# doc_block with a literal ID; and any literal that looks like a marker (a test
# helper may take the ID and call doc_block itself)
_CLAIM = re.compile(r"""doc_block\(\s*["']([^"']+)["']""")
_LITERAL = re.compile(r"""["']([a-z0-9_-]+(?:\.[a-z0-9_-]+)+)["']""")


def _sources() -> list[str]:
    return [path.read_text(encoding="utf-8") for path in (ROOT / "tests").rglob("*.py")]


def claimed() -> set[str]:
    return {m.group(1) for text in _sources() for m in _CLAIM.finditer(text)}


def named() -> set[str]:
    return {m.group(1) for text in _sources() for m in _LITERAL.finditer(text)}


def test_every_command_block_of_the_operator_docs_is_marked_for_a_test() -> None:
    unmarked = [b.where for b in all_blocks() if b.lang in COMMAND_LANGS and b.marker is None]
    assert not unmarked, f"command blocks no test runs (add <!-- run: ID -->): {unmarked}"


def test_every_marked_block_is_run_by_a_test_and_every_claim_is_a_block() -> None:
    markers = [b.marker for b in all_blocks() if b.marker is not None]
    assert len(markers) == len(set(markers)), "a marker names two blocks"
    assert set(markers) - named() == set(), "marked blocks no test runs"
    assert claimed() - set(markers) == set(), "tests run blocks no doc marks (renamed?)"


def test_marked_blocks_are_commands_or_the_configs_they_read() -> None:
    langs = {b.where: b.lang for b in all_blocks() if b.marker is not None}
    assert all(lang in COMMAND_LANGS | CONFIG_LANGS for lang in langs.values()), langs
