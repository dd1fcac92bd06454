"""Moved to :mod:`kvpool.ops.doctor.checks`; this name stays while
:mod:`kvpool.ops.checks_settings` (being merged into the connectors' settings) imports it."""

from kvpool.ops.doctor.checks import Check, Status, fail, pass_, skip, warn

__all__ = ["Check", "Status", "fail", "pass_", "skip", "warn"]
