"""Moved to :mod:`kvpool.ops.doctor.checks_connector`.  This name stays only while
:mod:`kvpool.ops.checks_settings` imports it (it moves into :mod:`kvpool.ops.doctor` with
the connectors' settings); delete it then.  A package rather than ``checks_connector.py``
so that git follows the module itself to its new place."""

from kvpool.ops.doctor.checks_connector import Side

__all__ = ["Side"]
