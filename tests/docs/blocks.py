"""The commands the operator docs tell a user to type, read from the docs themselves.

Every fenced block of commands (``bash``, ``sh``, ``console``) and every config block a
command reads (``toml``, ``json``, ``yaml``) in :data:`DOCS` carries a marker on the line
before it, ``<!-- run: ID -->``; a test runs the block by its ID with :func:`doc_block`,
so a doc edit that breaks a command fails that test, and ``test_coverage.py`` fails on a
block no test runs.  Placeholders are written as real example values (10.0.0.1, ...): a
test swaps them for its own hosts with :meth:`Block.text_for`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = (
    "README.md",
    "docs/quickstart.md",
    "docs/multihost.md",
    "docs/operations.md",
    "docs/monitoring.md",
    "docs/security.md",
    "docs/ha.md",
)
# python: a snippet the docs tell a user to run (the README's client) is run like a command
COMMAND_LANGS = frozenset({"bash", "sh", "console", "shell", "python"})
CONFIG_LANGS = frozenset({"toml", "json", "yaml"})
_MARKER = re.compile(r"^<!--\s*run:\s*(\S+)\s*-->\s*$")
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def text_for(self, values: dict[str, str]) -> str:
        """The block with each example value replaced (longest first, so 10.0.0.10 is
        not read as 10.0.0.1 followed by 0)."""
        text = self.text
        for old in sorted(values, key=len, reverse=True):
            text = text.replace(old, values[old])
        return text

    def commands(self, values: dict[str, str] | None = None) -> list[str]:
        """One shell command a line, continuation lines joined, comment lines dropped."""
        out: list[str] = []
        pending = ""
        for raw in self.text_for(values or {}).splitlines():
            line = raw.strip()
            if not pending and (not line or line.startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            out.append(pending + line)
            pending = ""
        return out


def read_blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[i - 1] if i else ""
        marker = _MARKER.match(before)
        text = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(doc, i + 1, fence.group(1), text, marker.group(1) if marker else None))
        i = end + 1
    return blocks


@cache
def all_blocks() -> tuple[Block, ...]:
    return tuple(b for doc in DOCS for b in read_blocks(doc))


def doc_block(marker: str) -> Block:
    """The one block marked ``<!-- run: marker -->`` in the operator docs."""
    found = [b for b in all_blocks() if b.marker == marker]
    assert len(found) == 1, f"{marker}: {len(found)} blocks carry this marker in {DOCS}"
    return found[0]
