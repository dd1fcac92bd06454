"""Which fabric moves the transfer connector's P→D pages, and whether this machine has it.

``protocol`` names the fabric and ``transport`` who drives it: kvpool's own TCP (``tcp``
only, its default), or Mooncake's Transfer Engine (the default for ``rdma``, a switch for
``tcp``).  :func:`fabric_refusal` is the pure rule; :func:`host_fabrics` looks at the host.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENGINE_INSTALL",
    "ENGINE_PROTOCOLS",
    "INFINIBAND",
    "SERVED_PROTOCOLS",
    "TRANSPORTS",
    "TRANSPORT_ENGINE",
    "TRANSPORT_KVPOOL",
    "HostFabrics",
    "fabric_refusal",
    "host_fabrics",
    "served_protocols",
]

# Who moves the transfer connector's P→D pages (the node config's "transport"): kvpool's
# own TCP, or Mooncake's Transfer Engine (registered memory, batch reads) over its fabrics.
TRANSPORT_KVPOOL = "kvpool"
TRANSPORT_ENGINE = "transfer_engine"
TRANSPORTS = (TRANSPORT_KVPOOL, TRANSPORT_ENGINE)
# Protocols only the Transfer Engine speaks.  Its other fabrics (nvlink, ascend, efa) need
# the matching Mooncake build and a device check of their own: one entry each, when added.
# (The engine's initialize() accepts any protocol name, so kvpool checks the device.)
ENGINE_PROTOCOLS: tuple[str, ...] = ("rdma",)
# Protocols every installation serves (kvpool's TCP); served_protocols() adds the rest.
SERVED_PROTOCOLS: tuple[str, ...] = ("tcp",)
INFINIBAND = "/sys/class/infiniband"  # the kernel's list of RDMA devices (device_name)
ENGINE_INSTALL = (
    "pip install 'kvpool[mooncake]' (mooncake-transfer-engine-non-cuda; scripts/setup.sh"
    " installs it with Debian's libibverbs1 ibverbs-providers librdmacm1 libnuma1)"
)


@dataclass(frozen=True, slots=True)
class HostFabrics:
    """What this machine offers the transfer connector's data plane (:func:`host_fabrics`
    probes it; the default offers kvpool's TCP only)."""

    engine: bool = False  # the mooncake extra with its Transfer Engine is installed
    rdma_devices: tuple[str, ...] | None = None  # INFINIBAND's entries; None: no directory


def host_fabrics(
    infiniband: str = INFINIBAND, *, find_spec: Callable[[str], Any] | None = None
) -> HostFabrics:
    """Probe this machine (edge): the mooncake extra, and the RDMA devices the kernel lists
    under ``infiniband``; both are parameters (``find_spec`` stands in for
    :func:`importlib.util.find_spec`) so that tests can point them elsewhere."""
    import importlib.util

    # Look for the engine's module in the package without importing it: importing
    # mooncake loads its native store library, a cost every config load would pay.
    spec = (find_spec or importlib.util.find_spec)("mooncake")
    places = list(spec.submodule_search_locations or ()) if spec is not None else []
    engine = any(
        glob.glob(os.path.join(place, pattern))
        for place in places
        for pattern in ("engine*.so", "engine.py", "engine/__init__.py")
    )
    try:
        devices: tuple[str, ...] | None = tuple(sorted(e.name for e in os.scandir(infiniband)))
    except OSError:
        devices = None
    return HostFabrics(engine=engine, rdma_devices=devices)


def served_protocols(fabrics: HostFabrics | None = None) -> tuple[str, ...]:
    """Protocols this installation can serve: tcp, and rdma where the Transfer Engine and
    at least one RDMA device are present (edge when ``fabrics`` is not given)."""
    fabrics = host_fabrics() if fabrics is None else fabrics
    rdma = ("rdma",) if fabrics.engine and fabrics.rdma_devices else ()
    return SERVED_PROTOCOLS + rdma


def fabric_refusal(
    protocol: str, transport: str, device_name: str, fabrics: HostFabrics
) -> str | None:
    """Why this machine cannot move P→D pages over ``protocol`` with ``transport``, as a
    one-line message that starts with the key to change and ends with the fix; ``None``
    when it can."""
    if transport == TRANSPORT_KVPOOL:
        return None
    if not fabrics.engine:
        way_out = 'remove "transport"' if protocol == "tcp" else 'set "protocol": "tcp"'
        return (
            f"protocol: {protocol!r} over Mooncake's Transfer Engine needs the mooncake extra,"
            f" which is not installed here: {ENGINE_INSTALL}, or {way_out}"
        )
    if protocol != "rdma":
        return None
    devices = fabrics.rdma_devices
    if not devices:
        state = "is empty" if devices is not None else "does not exist"
        return (
            f"protocol: 'rdma' needs an RDMA device, but {INFINIBAND} {state} on this machine:"
            " load the NIC's RDMA driver (rdma-core or the vendor's OFED; `ibv_devices` lists"
            ' what it found), or set "protocol": "tcp"'
        )
    wanted = [d.strip() for d in device_name.split(",") if d.strip()]
    missing = [d for d in wanted if d not in devices]
    if not wanted or missing:
        what = f"no RDMA device {', '.join(missing)}" if missing else "not set"
        return (
            f"device_name: {what} (protocol rdma; {INFINIBAND} lists {', '.join(devices)}):"
            f' set "device_name": "{devices[0]}", or set "protocol": "tcp"'
        )
    return None
