"""bench/flood.py runs end to end, small: every port's row, quiet and flooded, no errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "flood.py"


def test_every_port_has_a_quiet_and_a_flooded_row_without_errors() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--flood", "50", "--seconds", "0.5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    for line in done.stdout.splitlines()[2:]:
        *name, unit, quiet, flooded, _ratio, errors = line.split()
        rows[" ".join(name)] = (unit, float(quiet), float(flooded), int(errors))
    assert set(rows) == {"node data port", "master RPC", "master HTTP", "kv_port (kvpool TCP)"}
    for unit, quiet, flooded, errors in rows.values():
        assert quiet > 0 and flooded > 0 and errors == 0, (unit, quiet, flooded, errors)
