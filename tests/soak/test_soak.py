"""A bounded soak: a real pool under mixed traffic, evicting and demoting all the time,
with its storage node SIGKILLed and restarted once; no wrong byte, no leak.

Set-up: a master with a 4 MiB segment and its own SSD tier, one ``kvpool node`` with a
2 MiB segment and its own SSD tier, and three client processes (:mod:`tests.soak.traffic`):
one on the same-host path (shared memory), two over TCP, each doing puts, batch puts, gets,
batch gets, exists and removes of 1-96 KiB values on 120 keys of its own, so the pool
(6 MiB of memory for ~15 MiB of live values) evicts and demotes on nearly every put.

Checked:
- every value read is a miss or exactly a version written for that key (each client checks
  each byte; see :mod:`tests.soak.traffic`), and no client raises outside the error tree;
- no reply is ``INTERNAL`` (ordinary traffic and a node's death are not bugs);
- the pool really was under pressure: memory evictions and SSD demotions happened;
- the master's RSS and open file descriptors stay flat (see :func:`assert_flat`).

The run is paced by what the pool did, not by a clock: the node is killed once the pool has
demoted :data:`OFFLOADS_BEFORE_KILL` objects, and the clients are stopped once the
restarted node is back and :data:`OFFLOADS_AFTER_RESTART` more were demoted.  Every wait
and every client loop is bounded by count and by time as well; the whole test takes
about a minute here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvpool.net import http_get
from kvpool.testing import lifetime
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

OFFLOADS_BEFORE_KILL = 1_500
OFFLOADS_AFTER_RESTART = 4_000
PHASE_TIMEOUT_S = 90.0  # each phase takes ~10-20 s on the 2-core reference machine
CLIENT_SECONDS = 3 * PHASE_TIMEOUT_S  # a client's own bound, past every phase's
CLIENT_MAX_OPS = 200_000
SAMPLE_S = 0.25
MAX_SAMPLES = 2_000  # bounds the sampler even if the clients never end
ROOT = Path(__file__).resolve().parents[2]  # the clients run ``-m tests.soak.traffic`` here


def master_usage(pid: int) -> tuple[int, int]:
    """(RSS in bytes, open file descriptors) of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Sampler(threading.Thread):
    """Samples the master's usage every :data:`SAMPLE_S` until stopped (bounded)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while len(self.samples) < MAX_SAMPLES and not self.stop.wait(SAMPLE_S):
            self.samples.append(master_usage(self.pid))


def assert_flat(samples: list[tuple[int, int]]) -> None:
    """The last third of the run against the first third.

    The bound is generous on purpose: the first third already holds the pool's working set
    (the segment's pages are touched within the first seconds, the index has its ~360
    keys), so what may still grow is allocator noise — CPython's arenas and uvloop's
    buffers settle at their high-water mark rather than shrinking — which is a few MiB
    (60 → 72 MiB over a whole run on the reference machine, flat in its second half).  A
    leak per request or per connection grows with the ~100,000 operations the run makes
    and shows as far more than 16 MiB or 25% over the first third's peak.  File
    descriptors may differ by the clients' reconnections after the node's restart (a
    handful), never by one per request.
    """
    assert len(samples) >= 30, f"only {len(samples)} samples of the master's usage"
    third = len(samples) // 3
    first, last = samples[:third], samples[-third:]
    first_rss = max(rss for rss, _ in first)
    last_rss = sorted(rss for rss, _ in last)[len(last) // 2]
    assert last_rss <= first_rss * 1.25 + (16 << 20), (first_rss, last_rss)
    first_fds = max(fds for _, fds in first)
    last_fds = max(fds for _, fds in last)
    assert last_fds <= first_fds + 8, (first_fds, last_fds)


def start_clients(
    tmp_path: Path, master: str, stop_file: Path
) -> list[tuple[subprocess.Popen[str], Path]]:
    clients = []
    for name, transport in (("c0", "shm"), ("c1", "tcp"), ("c2", "tcp")):
        out = tmp_path / f"{name}.json"
        argv = [
            sys.executable,
            "-m",
            "tests.soak.traffic",
            f"--master={master}",
            f"--name={name}",
            f"--transport={transport}",
            f"--seconds={CLIENT_SECONDS}",
            f"--max-ops={CLIENT_MAX_OPS}",
            f"--stop-file={stop_file}",
            f"--out={out}",
        ]
        proc = lifetime.popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        clients.append((proc, out))
    return clients


def stats(master: PoolProcess) -> dict[str, Any]:
    reply = http_get(f"http://{master.address}/api/status", timeout_s=10)
    assert reply.ok, reply.error
    return dict(json.loads(reply.body))


def offloads(master: PoolProcess) -> int:
    return int(stats(master)["stats"]["offloads"])


def offloads_reach(master: PoolProcess, count: int, what: str) -> None:
    """Until the master has demoted ``count`` objects in all (bounded by a phase)."""
    wait_until(lambda: offloads(master) >= count, PHASE_TIMEOUT_S, interval_s=0.2, what=what)


def serves(master: PoolProcess, node: PoolProcess) -> bool:
    """The master lists ``node``'s data address with its segments."""
    return any(c["address"] == node.address and c["segments"] for c in stats(master)["clients"])


def test_soak_mixed_traffic_with_a_node_killed_and_restarted(tmp_path: Path) -> None:
    env = {"OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(64 << 20)}
    flags = (
        "--segment_size=4MiB",
        "--enable_offload=true",
        f"--ssd_offload_path={tmp_path / 'master-ssd'}",
        "--ssd_offload_limit=32MiB",
        "--client_ttl=2",
    )
    with start_master(*flags, env=env, log_path=tmp_path / "master.log") as master:
        ssd = {"ssd_offload_path": str(tmp_path / "node-ssd"), "ssd_offload_limit": "24MiB"}
        config = node_config(tmp_path, master.address, "2MiB", enable_ssd_offload=True, **ssd)
        node = start_node(config)
        killed = node.pid  # its /dev/shm segment is removed at the end if still there
        stop_file = tmp_path / "stop"
        clients = start_clients(tmp_path, master.address, stop_file)
        sampler = Sampler(master.pid)
        sampler.start()
        try:
            wait_until(lambda: serves(master, node), PHASE_TIMEOUT_S, what="the node joined")
            offloads_reach(master, OFFLOADS_BEFORE_KILL, "demotions under the clients' traffic")
            # the node dies without a word, then comes back on the same SSD directory
            node.kill()
            node = start_node(config)
            wait_until(lambda: serves(master, node), PHASE_TIMEOUT_S, what="the node rejoined")
            target = offloads(master) + OFFLOADS_AFTER_RESTART
            offloads_reach(master, target, "demotions after the node's restart")
            stop_file.touch()
            outputs = []
            for proc, _ in clients:
                out, _ = proc.communicate(timeout=PHASE_TIMEOUT_S)
                outputs.append(out)
        finally:
            sampler.stop.set()
            sampler.join(10)
            for proc, _ in clients:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            snapshot = stats(master) if master.proc.poll() is None else {}
            node.stop()
            for leftover in Path("/dev/shm").glob(f"kvpool-{killed}-*"):
                leftover.unlink(missing_ok=True)  # what a SIGKILLed node could not remove
        assert master.proc.poll() is None, "\n".join(master.lines)
    for (proc, _), out in zip(clients, outputs, strict=True):
        assert proc.returncode == 0, out
    results = [json.loads(path.read_text()) for _, path in clients]
    reads = sum(r["reads"] for r in results)
    wrong = [w for r in results for w in r["wrong"]]
    crashes = [c for r in results for c in r["crashes"]]
    errors = sum((Counter(r["errors"]) for r in results), Counter())
    assert not wrong, wrong[:10]
    assert not crashes, crashes[0]
    assert errors["KVPoolError"] == 0, errors  # an untyped error is an INTERNAL one
    hits = reads - sum(r["misses"] for r in results)
    assert reads > 1000 and hits > reads // 10, (reads, hits)  # traffic, and real hits
    counters = snapshot["stats"]
    assert isinstance(counters, dict)
    # memory evictions became SSD demotions ("evictions" counts only objects dropped)
    assert counters["offloads"] > 0, counters
    assert_flat(sampler.samples)
