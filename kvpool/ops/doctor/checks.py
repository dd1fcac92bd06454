"""The result of one doctor check, and the vocabulary every check module shares.  A part
below ops (an engine's adapter) writes lines of the same shape without importing doctor;
:func:`as_checks` takes them into the report as is.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Check", "CheckLine", "Status", "as_checks", "fail", "pass_", "skip", "warn"]


class Status(enum.Enum):
    """PASS: fine.  WARN: works, but not as the production guide recommends.  FAIL: will break.
    SKIP: the inputs this check needs were not given (the message says which)."""

    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of doctor's report: ``name`` is stable (scripts may match on it)."""

    name: str
    status: Status
    message: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "status": self.status.value,
            "message": self.message,
            "fix": self.fix,
        }


def pass_(name: str, message: str) -> Check:
    return Check(name, Status.PASS, message)


def warn(name: str, message: str, fix: str) -> Check:
    return Check(name, Status.WARN, message, fix)


def fail(name: str, message: str, fix: str) -> Check:
    return Check(name, Status.FAIL, message, fix)


def skip(name: str, message: str) -> Check:
    return Check(name, Status.SKIP, message)


class CheckLine(Protocol):
    """A check judged below ops: a :class:`Check`'s fields, its status as the
    :class:`Status` value's text."""

    @property
    def name(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def message(self) -> str: ...

    @property
    def fix(self) -> str: ...


def as_checks(lines: Iterable[CheckLine]) -> list[Check]:
    """Lines judged below ops, as the report's checks, in their order."""
    return [Check(line.name, Status(line.status), line.message, line.fix) for line in lines]
