"""What a module imports, read with ``ast`` (imports inside functions included): for the
tests that hold one package's own shape beyond the layering table (no I/O in its pure
modules, no reach into a part above it)."""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["imports_of", "under"]


def imports_of(path: Path) -> set[str]:
    """Every module the file at ``path`` imports by absolute name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def under(module: str, prefixes: set[str]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or inside one of them."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)
