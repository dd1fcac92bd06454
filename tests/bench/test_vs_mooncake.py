"""bench/vs_mooncake.py runs end to end with tiny sizes and rounds and prints every row,
ratios included.  What it measures is not asserted: only that each cell is a number."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vs_mooncake.py"
TINY = ("--sizes", "4KiB,64KiB", "--batch", "2", "--rounds", "2", "--seconds", "0.01")
NUMBER = re.compile(r"^\d+\.\d+$")
RATIO = re.compile(r"^\d+\.\d+×$")


def run_bench(pythonpath: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--meta-count", "50", "--markdown"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def tables(out: str) -> list[dict[str, list[str]]]:
    """Each markdown table as {first two cells joined: the row's cells}."""
    found: list[dict[str, list[str]]] = []
    for block in out.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.startswith("|")]
        if len(lines) < 2:
            continue
        cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
        found.append({" ".join(row[:2]): row for row in cells[2:]})
    return found


EXPECTED = [
    f"{size} {op}"
    for size in ("4 KiB", "64 KiB")
    for op in ("put", "get", "batch×2 put", "batch×2 get")
]


def test_every_row_with_both_engines_and_every_ratio() -> None:
    transfer, meta = tables(run_bench(str(ROOT)))
    assert list(transfer) == EXPECTED
    for name, row in transfer.items():
        kvpool, mooncake, *ratios, raw, memcpy = row[2:]
        assert all(NUMBER.match(c) for c in (kvpool, mooncake, raw)), (name, row)
        assert all(RATIO.match(c) for c in (*ratios, memcpy)), (name, row)
    assert [r[0] for r in meta.values()] == [
        "exists",
        "batch_exists(64)",
        "raw TCP 1-byte round trip",
    ]
    for row in list(meta.values())[:2]:
        assert all(c.isdigit() for c in row[1:5]), row
        assert all(RATIO.match(c) for c in row[5:]), row


def test_without_the_wheel_mooncake_rows_are_skipped_with_a_line(tmp_path: Path) -> None:
    # a "mooncake" package without the wheel's binaries, found first
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    out = run_bench(os.pathsep.join((str(tmp_path), str(ROOT))))
    assert re.search(r"^Mooncake rows skipped: .*mooncake_master", out, re.M), out
    transfer, meta = tables(out)
    assert list(transfer) == EXPECTED
    for name, row in transfer.items():
        kvpool, mooncake, vs_mooncake, vs_raw, mooncake_vs_raw, raw, memcpy = row[2:]
        assert (mooncake, vs_mooncake, mooncake_vs_raw) == ("—", "—", "—"), (name, row)
        assert NUMBER.match(kvpool) and NUMBER.match(raw), (name, row)
        assert RATIO.match(vs_raw) and RATIO.match(memcpy), (name, row)
    for row in list(meta.values())[:2]:
        assert row[1].isdigit() and row[2].isdigit() and row[3:6] == ["—"] * 3, row
