"""What a run leaves in ``/dev/shm``: files no live process holds open or mapped.

The suite checks at its end that it left nothing; a fixture that SIGKILLs vLLM's engines
removes the ``psm_*`` and ``vllm_dist_*`` files they leave with :func:`remove_orphans`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["held_inodes", "held_paths", "orphans", "remove_orphans", "snapshot"]

SHM_DIR = Path("/dev/shm")


def snapshot(directory: Path = SHM_DIR) -> set[str]:
    """The names in ``directory`` now."""
    try:
        return {entry.name for entry in directory.iterdir()}
    except OSError:
        return set()


def held_paths(directory: Path = SHM_DIR) -> set[str]:
    """Paths under ``directory`` that some live process has open or mapped."""
    inodes = held_inodes(directory)
    held: set[str] = set()
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            with contextlib.suppress(OSError):
                if entry.stat().st_ino in inodes:
                    held.add(str(entry))
    return held


def held_inodes(directory: Path = SHM_DIR) -> set[int]:
    """Inodes under ``directory`` that some live process has open or mapped.  By inode,
    not by path: glibc makes a named semaphore under a temporary name and links it to
    its own, so its mapping shows the temporary one (``sem.XXXXXX (deleted)``)."""
    prefix = str(directory).rstrip("/") + "/"
    held: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    held.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith(prefix):
                        held.add(os.stat(fd).st_ino)
    return held


def orphans(before: set[str], directory: Path = SHM_DIR) -> list[str]:
    """Names that appeared since ``before`` and that no live process holds."""
    new = snapshot(directory) - before
    if not new:
        return []
    held = held_inodes(directory)
    out = []
    for name in new:
        try:
            inode = (directory / name).stat().st_ino
        except OSError:
            continue  # gone meanwhile
        if inode not in held:
            out.append(name)
    return sorted(out)


def remove_orphans(before: set[str], directory: Path = SHM_DIR) -> list[str]:
    """Unlink :func:`orphans`; return their names."""
    removed = []
    for name in orphans(before, directory):
        with contextlib.suppress(OSError):
            (directory / name).unlink()
            removed.append(name)
    return removed
