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


def test_a_live_named_semaphore_is_held_though_mapped_under_another_name() -> None:
    # glibc maps a named semaphore under the temporary name it was made as: a check by
    # path took a live one (a vLLM engine's, while it spawned workers) for an orphan
    import multiprocessing

    before = shm.snapshot()
    lock = multiprocessing.get_context("spawn").Lock()
    try:
        made = [n for n in shm.snapshot() - before if n.startswith("sem.mp-")]
        assert made, "the lock made no named semaphore"
        assert not set(made) & set(shm.orphans(before))
    finally:
        del lock
