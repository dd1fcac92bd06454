"""The result of one doctor check, and the vocabulary every check module shares."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Check", "Status", "fail", "pass_", "skip", "warn"]


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
