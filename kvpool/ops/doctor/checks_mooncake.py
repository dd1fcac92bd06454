"""Doctor's checks of real Mooncake: :mod:`kvpool.mooncake.doctor`'s findings as checks.

The judging is pure and lives with the rest of Mooncake; this module only turns its
findings into :class:`~kvpool.ops.doctor.checks.Check` lines, so that doctor imports
``kvpool.mooncake`` and never the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.config.node import MooncakeNodeConfig
from kvpool.mooncake import doctor
from kvpool.mooncake.doctor import MOONCAKE_RPC_PORT, Finding
from kvpool.mooncake.ha import MooncakeHA
from kvpool.mooncake.master import MooncakeMasterFacts
from kvpool.ops.doctor.checks import Check, Status

__all__ = [
    "MOONCAKE_RPC_PORT",
    "check_mooncake_config",
    "check_mooncake_leadership",
    "check_mooncake_master",
    "check_mooncake_security",
]


def _checks(findings: Iterable[Finding]) -> list[Check]:
    return [Check(f.name, Status(f.status), f.message, f.fix) for f in findings]


def check_mooncake_config(
    source: str, config: MooncakeNodeConfig, rdma_devices: Sequence[str] | None
) -> list[Check]:
    """A Mooncake mooncake.json (:func:`kvpool.mooncake.doctor.config_findings`)."""
    return _checks(doctor.config_findings(source, config, rdma_devices))


def check_mooncake_master(address: str, facts: MooncakeMasterFacts) -> list[Check]:
    """A Mooncake master answered at (or beside) ``address``: the §8.1 facts."""
    return _checks(doctor.master_findings(address, facts))


def check_mooncake_leadership(ha: MooncakeHA) -> Check:
    """Mooncake's own HA masters: who leads, and the standbys where they are known."""
    return _checks([doctor.leadership_finding(ha)])[0]


def check_mooncake_security() -> Check:
    """Mooncake has no authentication: say so, with what protects the pool instead."""
    return _checks([doctor.security_finding()])[0]
