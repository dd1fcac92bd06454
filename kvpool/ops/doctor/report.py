"""``kvpool doctor``'s report: one line per check with its fix, or JSON; and the exit
status (1 when any check failed)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvpool.ops.doctor.checks import Check, Status

__all__ = ["exit_code", "format_json", "format_text"]


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


def _summary(checks: Sequence[Check]) -> dict[str, int]:
    return {s.value.lower(): sum(c.status is s for c in checks) for s in Status}


def format_text(checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=10)
    lines = []
    for c in checks:
        line = f"{c.status.value:<4}  {c.name:<{width}}  {c.message}"
        lines.append(line + (f" — fix: {c.fix}" if c.fix else ""))
    counts = _summary(checks)
    lines.append(
        f"{counts['fail']} failed, {counts['warn']} warnings, {counts['pass']} passed,"
        f" {counts['skip']} skipped"
    )
    return "\n".join(lines)


def format_json(checks: Sequence[Check]) -> str:
    return json.dumps(
        {
            "ok": exit_code(checks) == 0,
            "summary": _summary(checks),
            "checks": [c.to_dict() for c in checks],
        },
        indent=2,
        ensure_ascii=False,
    )
