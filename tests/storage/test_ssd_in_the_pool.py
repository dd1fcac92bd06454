"""Any key a client may put works in the SSD tier of a real master (issue 11, item 1).

The reproduction the issue gives: a master with a 4 MiB segment, offload on, LRU; put
keys the SSD tier once refused next to a plain one, then fill memory so that all of them
are demoted.  Before file names were derived from a hash of the key, ``a/b`` made the
demotion raise part-way: the put that triggered it failed with ``INTERNAL``, and objects
the index listed on SSD (``plain`` among them) were missing there.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.client.client import Client
from kvpool.storage.ssd import files_by_key
from kvpool.testing.processes import start_master

KIB = 1024
ODD_KEYS = ["a/b", "model@tp:0", "Qwen/Qwen3-8B@pcp0@tp3@9f86d0", "ключ-鍵-🔑", "k" * 10_000, ".."]


def test_odd_keys_are_demoted_read_and_removed_and_never_cost_another_key(
    tmp_path: Path,
) -> None:
    ssd = tmp_path / "ssd"
    flags = (
        "--segment_size=4MiB",
        "--enable_offload=true",
        f"--ssd_offload_path={ssd}",
        "--ssd_offload_limit=64MiB",
        "--eviction_policy=lru",
    )
    values = {key: os.urandom(64 * KIB) for key in [*ODD_KEYS, "plain"]}
    with start_master(*flags) as master, Client(master.address, allow_shm=False) as c:
        for key, value in values.items():
            c.put(key, value)
        for i in range(32):  # 8 MiB through a 4 MiB segment: the first puts go to SSD
            c.put(f"fill-{i:02d}", os.urandom(256 * KIB))
        assert c.stats()["stats"]["offloads"] > 0
        for key, value in values.items():
            assert c.exists(key), key
            assert c.get(key) == value, key
        on_ssd = files_by_key(ssd)
        assert set(values) <= set(on_ssd)  # every one of them was demoted, under its key
        for key in ODD_KEYS:
            assert c.remove(key) and not c.exists(key)
            assert not on_ssd[key].exists()
        assert c.get("plain") == values["plain"]
        assert master.stop() == 0
