"""What a run leaves in ``/dev/shm``: files no live process holds open or mapped.

The suite checks at its end that it left nothing (tests/conftest.py); a fixture that
kills processes with SIGKILL (vLLM's engines leave ``psm_*`` and ``vllm_dist_*`` files
then) removes what they left with :func:`remove_orphans`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["held_paths", "orphans", "remove_orphans", "snapshot"]

SHM_DIR = Path("/dev/shm")


def snapshot(directory: Path = SHM_DIR) -> set[str]:
    """The names in ``directory`` now."""
    try:
        return {entry.name for entry in directory.iterdir()}
    except OSError:
        return set()


def held_paths(directory: Path = SHM_DIR) -> set[str]:
    """Paths under ``directory`` that some live process has open or mapped."""
    prefix = str(directory).rstrip("/") + "/"
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(prefix):
                    held.add(path.removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(prefix):
                        held.add(target)
    return held


def orphans(before: set[str], directory: Path = SHM_DIR) -> list[str]:
    """Names that appeared since ``before`` and that no live process holds."""
    new = snapshot(directory) - before
    if not new:
        return []
    held = held_paths(directory)
    return sorted(name for name in new if str(directory / name) not in held)


def remove_orphans(before: set[str], directory: Path = SHM_DIR) -> list[str]:
    """Unlink :func:`orphans`; return their names."""
    removed = []
    for name in orphans(before, directory):
        with contextlib.suppress(OSError):
            (directory / name).unlink()
            removed.append(name)
    return removed
