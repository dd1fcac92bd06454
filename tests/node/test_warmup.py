"""Warm segments, as real master and node processes: after start the segment's pages are
resident in the owner (its /proc/PID/smaps) and ``kvpool status`` says warm; with
``segment_warmup`` off they are left to fault on first touch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.net import http_get
from kvpool.ops.status import SegmentInfo, fetch_snapshot
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.waiting import wait_until

SIZE = 32 << 20


def resident(pid: int) -> int:
    """Resident bytes of ``pid``'s mapping of its own segment (/dev/shm/kvpool-PID-…)."""
    total, inside, found = 0, False, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = fields[-1].startswith(f"/dev/shm/kvpool-{pid}-")
            found = found or inside
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    assert found, f"process {pid} maps no segment of its own"
    return total


def segment_of(master: PoolProcess, owner: str) -> SegmentInfo | None:
    snap = fetch_snapshot(master.address)
    return next((s for s in snap.segments if s.client_id.startswith(owner)), None)


def warm(master: PoolProcess, owner: str) -> SegmentInfo:
    return wait_until(
        lambda: (seg := segment_of(master, owner)) is not None and seg.warm == "warm" and seg,
        timeout_s=60,
        what=f"{owner}'s segment warm",
    )


def test_the_masters_segment_warms_in_the_background_by_default() -> None:
    with start_master("--segment_size", str(SIZE)) as master:
        seg = warm(master, "master")
        assert (seg.segment_id, seg.warmed_bytes, seg.capacity) == ("master/mem", SIZE, SIZE)
        assert resident(master.pid) == SIZE
        metrics = http_get(f"http://{master.address}/metrics", 5.0).body.decode()
        gauges = {
            s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
        }
        assert gauges["kvpool_memory_warm_bytes"] == SIZE
        assert gauges["kvpool_segments_warming"] == 0


def test_sync_warmup_is_warm_before_the_master_serves() -> None:
    with start_master("--segment_size", str(SIZE), "--segment_warmup=sync") as master:
        seg = segment_of(master, "master")  # the first answer it gives: warm already
        assert seg is not None and seg.warm == "warm" and seg.warmed_bytes == SIZE
        assert resident(master.pid) == SIZE


def test_with_warmup_off_the_pages_are_not_populated() -> None:
    with start_master("--segment_size", str(SIZE), "--segment_warmup", "off") as master:
        seg = segment_of(master, "master")
        assert seg is not None and (seg.warm, seg.warmed_bytes) == ("off", 0)
        assert resident(master.pid) == 0
        assert "off (each page faults on first touch)" in seg.pages()


@pytest.mark.parametrize("mode", ["background", "off"])
def test_a_nodes_segment_warmth_reaches_kvpool_status(tmp_path: Path, mode: str) -> None:
    with start_master("--segment_size", "0") as master:
        config = node_config(tmp_path, master.address, str(SIZE), segment_warmup=mode)
        with start_node(config) as node:
            if mode == "background":
                seg = warm(master, "node-")
                assert seg.warmed_bytes == SIZE
                assert resident(node.pid) == SIZE
            else:
                seg = wait_until(lambda: segment_of(master, "node-"), what="node registered")
                assert (seg.warm, seg.warmed_bytes) == ("off", 0)
                assert resident(node.pid) == 0
            done = subprocess.run(
                [sys.executable, "-m", "kvpool", "status", "--master", master.address, "--json"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            (shown,) = [
                s for s in json.loads(done.stdout)["segments"] if s["client_id"] != "master"
            ]
            assert shown["warm"] == ("warm" if mode == "background" else "off")


def test_a_master_stopped_while_it_warms_exits_cleanly_and_leaves_no_segment() -> None:
    with start_master("--segment_size", "512MiB") as master:
        # SIGTERM at once: the warmer (done or part-way) is stopped and joined, then the
        # segment is unmapped and unlinked (looked at before stop() would clean up)
        master.proc.send_signal(signal.SIGTERM)
        assert master.proc.wait(60) == 0, "\n".join(master.lines)
        assert not list(Path("/dev/shm").glob(f"kvpool-{master.pid}-*"))
    assert not any("Traceback" in line for line in master.lines)
