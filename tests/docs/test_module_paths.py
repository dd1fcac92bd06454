"""Every ``kvpool.…`` path the docs name still resolves, the way a user's config or code
would reach it (``importlib``, then attributes): a module that moves must take its
documented paths with it, ``kv_connector_module_path`` values first among them."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from kvpool.testing.fresh import run_python

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS += sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file())
_PATH = re.compile(r"\bkvpool(?:\.[A-Za-z_]\w*)+")
# what can follow kvpool. in a path: its modules and packages, and its public names
_HEADS = {p.stem for p in (ROOT / "kvpool").iterdir() if p.suffix == ".py" or p.is_dir()}
_HEADS |= set(importlib.import_module("kvpool").__all__)


def _documented() -> dict[str, str]:
    """path → the first file naming it (``kvpool.json`` and other file names left out)."""
    found: dict[str, str] = {}
    for text in TEXTS:
        for match in _PATH.finditer(text.read_text(errors="replace")):
            path = match.group().rstrip(".")
            if path.split(".")[1] in _HEADS:
                found.setdefault(path, str(text.relative_to(ROOT)))
    return found


DOCUMENTED = _documented()


def test_the_docs_name_the_connector_paths() -> None:
    assert {"kvpool.connectors.store", "kvpool.connectors.transfer"} <= set(DOCUMENTED)


@pytest.mark.parametrize("path", sorted(DOCUMENTED))
def test_a_documented_path_resolves(path: str) -> None:
    # In a fresh interpreter: what this process already imported must not hide a missing
    # module, and the longest importable prefix is the module, the rest attributes.
    code = (
        "import importlib, sys\n"
        f"pieces = {path!r}.split('.')\n"
        "for n in range(len(pieces), 0, -1):\n"
        "    try:\n"
        "        value = importlib.import_module('.'.join(pieces[:n]))\n"
        "    except ModuleNotFoundError as exc:\n"
        "        if not '.'.join(pieces[:n]).startswith(exc.name or '?'):\n"
        "            raise\n"
        "        continue\n"
        "    for attr in pieces[n:]:\n"
        "        value = getattr(value, attr)\n"
        "    break\n"
    )
    done = run_python(code)
    assert done.returncode == 0, f"{path} ({DOCUMENTED[path]}): {done.stderr[-2000:]}"
