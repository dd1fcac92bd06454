"""The suite's /dev/shm check (tests/conftest.py) finds what no live process holds."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

from kvpool.testing import shm


def test_orphans_are_new_files_no_live_process_holds(tmp_path: Path) -> None:
    (tmp_path / "there-before").write_bytes(b"x")
    before = shm.snapshot(tmp_path)
    (tmp_path / "psm_left").write_bytes(b"x" * 4096)
    mapped, opened = tmp_path / "psm_mapped", tmp_path / "kvpool-1-0123456789ab"
    mapped.write_bytes(b"x" * 4096)
    opened.write_bytes(b"x")
    with open(mapped, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)  # the file closed, the mapping kept
    holder = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(opened)!r}); input()"],
        stdin=subprocess.PIPE,
    )
    try:
        for _ in range(200):  # until the child has opened it (bounded)
            if str(opened) in shm.held_paths(tmp_path):
                break
            holder.poll()
            subprocess.run(["sleep", "0.05"])
        assert shm.orphans(before, tmp_path) == ["psm_left"]
        assert shm.remove_orphans(before, tmp_path) == ["psm_left"]
        assert shm.snapshot(tmp_path) == {"there-before", "psm_mapped", opened.name}
    finally:
        holder.kill()
        holder.wait(10)
        assert holder.stdin is not None
        holder.stdin.close()
        mapping.close()
    assert shm.orphans(before, tmp_path) == sorted([opened.name, "psm_mapped"])
