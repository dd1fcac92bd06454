"""``kvpool up``: the whole P/D stack on one machine (master, prefill and decode vLLM, proxy)
in one command, on kvpool's master or (``--engine mooncake``) on real Mooncake.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvpool.ops.up.options import UpOptions, default_state_dir, options_from_args
from kvpool.ops.up.plan import ProcessSpec, UpPlan, make_plan

if TYPE_CHECKING:
    from kvpool.ops.up.lifecycle import STATE_FILE, resolve_ports, run, usable_cpus

__all__ = [
    "STATE_FILE",
    "ProcessSpec",
    "UpOptions",
    "UpPlan",
    "default_state_dir",
    "make_plan",
    "options_from_args",
    "resolve_ports",
    "run",
    "usable_cpus",
]

# The edge (rich, signals, subprocesses) loads on first use: building ``kvpool``'s parser
# reads the port flags from .options and should not pay for it.
_LIFECYCLE = ("STATE_FILE", "resolve_ports", "run", "usable_cpus")


def __getattr__(name: str) -> Any:
    if name in _LIFECYCLE:
        return getattr(importlib.import_module("kvpool.ops.up.lifecycle"), name)
    raise AttributeError(f"module 'kvpool.ops.up' has no attribute {name!r}")
