"""``kvpool doctor``: the production guide's troubleshooting table and checklist as one command.

Only :mod:`.gather` and :mod:`.probes` do I/O, every probe bounded by a timeout; the
``checks_*`` modules and :mod:`.diagnose` are pure, so the tests drive them with broken setups.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from kvpool.ops.doctor.checks import Check, Status
from kvpool.ops.doctor.diagnose import diagnose
from kvpool.ops.doctor.facts import Gathered
from kvpool.ops.doctor.gather import gather, read_connector_input
from kvpool.ops.doctor.options import DoctorOptions
from kvpool.ops.doctor.report import exit_code, format_json, format_text

__all__ = [
    "Check",
    "DoctorOptions",
    "Gathered",
    "Status",
    "diagnose",
    "exit_code",
    "format_json",
    "format_text",
    "gather",
    "read_connector_input",
    "run",
    "run_doctor",
]


def run_doctor(options: DoctorOptions, env: Mapping[str, str] | None = None) -> list[Check]:
    """Every check for ``options`` (``env`` replaces ``os.environ`` for tests)."""
    return diagnose(gather(options, env))


def run(options: DoctorOptions) -> int:
    """``kvpool doctor``: print the report; exit status 1 when a check failed, else 0."""
    checks = run_doctor(options)
    try:
        print(format_json(checks) if options.as_json else format_text(checks), flush=True)
    except BrokenPipeError:  # `kvpool doctor | head`: the reader left; the status stands
        sys.stderr.close()
    return exit_code(checks)
