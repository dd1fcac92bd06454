"""Traffic that moves every counter a master exports: the deploy tests' workload.

Meant for a master with ``--segment_size 1MB --enable_offload=true
--ssd_offload_limit=1MB`` (:data:`MASTER_FLAGS`): 3 MB of puts into 1 MiB of memory and
1 MiB of SSD make the memory tier demote and the SSD tier evict; gets hit in both tiers
and miss; a prefix lookup counts blocks and tokens; a put larger than the pool is
refused.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.errors import NoSpace, ObjectNotFound


def master_flags(ssd: Path) -> list[str]:
    """The master the workload is sized for, its SSD tier in ``ssd``."""
    return [
        "--segment_size",
        "1MB",
        "--enable_offload=true",
        f"--ssd_offload_path={ssd}",
        "--ssd_offload_limit=1MB",
    ]


def touch_every_counter(client: Client, prefix: str = "dash") -> None:
    """One round of the workload; another ``prefix`` puts new keys (a stored key's put
    is a no-op and counts nothing)."""
    keys = [f"{prefix}-{i}" for i in range(90)]
    for key in keys:  # ~3 MB into 1 MiB + 1 MiB (Mooncake's MB): memory demotes, SSD evicts
        client.put(key, key.encode() * 5000)
    for key in [*keys, "absent"]:
        with contextlib.suppress(ObjectNotFound):
            client.get(key)
    client.prefix_lookup(keys, tokens_per_key=16)
    with pytest.raises(NoSpace):
        client.put("too-big", b"x" * 3_000_000)
