"""Moved to :mod:`kvpool.ops.doctor.checks`.  This name stays only while
:mod:`kvpool.ops.checks_settings` imports it (it moves into :mod:`kvpool.ops.doctor` with
the connectors' settings); delete it then."""

from kvpool.ops.doctor.checks import Check, Status, fail, pass_, skip, warn

__all__ = ["Check", "Status", "fail", "pass_", "skip", "warn"]
