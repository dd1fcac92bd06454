"""Moved to :mod:`kvpool.ops.doctor.checks_connector`; this name stays while
:mod:`kvpool.ops.checks_settings` (being merged into the connectors' settings) imports it."""

from kvpool.ops.doctor.checks_connector import Side

__all__ = ["Side"]
