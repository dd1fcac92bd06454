"""``kvpool status``: the picture as a pure function of a snapshot, then the command
against a real master process after real puts and gets."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvpool.client.client import Client
from kvpool.errors import ObjectNotFound, ProtocolError, TransferError
from kvpool.net import free_port
from kvpool.ops.status import (
    PoolSnapshot,
    Ratio,
    StatusOptions,
    default_master,
    fetch_snapshot,
    parse_snapshot,
    rates,
    render,
    run,
)
from kvpool.testing.processes import PoolProcess, start_master

STATUS: dict[str, Any] = {
    "uptime_s": 125.0,
    "tiers": {
        "memory": {"capacity": 4 * 2**30, "used": 3 * 2**30, "objects": 1200},
        "ssd": {"capacity": 0, "used": 0, "objects": 0},
    },
    "objects": 1200,
    "pending": 2,
    "clients": [
        {
            "client_id": "node-p0",
            "address": "10.0.0.1:40000",
            "last_heartbeat_ms_ago": 800,
            "segments": ["node-p0/mem"],
        },
        {
            "client_id": "node-d0",
            "address": "10.0.0.2:40000",
            "last_heartbeat_ms_ago": 45_000,
            "segments": [],
        },
    ],
    "active_leases": 3,
    "stats": {
        "evictions": 7,
        "offloads": 5,
        "demote_failures": 1,
        "put_failures_no_space": 2,
        "expired_leases": 4,
        "revoked_writes": 1,
    },
    "lookups": {
        "gets": 800.0,
        "get_hits": 300.0,
        "prefix_blocks_queried": 64.0,
        "prefix_blocks_hit": 16.0,
        "prefix_tokens_queried": 1024.0,
        "prefix_tokens_hit": 256.0,
    },
    "recent_errors": ["PutStart: NO_SPACE: no memory segment can hold 9 bytes"],
    "config": {"host": "10.0.0.1", "port": 50088, "eviction_high_watermark_ratio": 0.9},
}

METRICS = """\
# HELP kvpool_puts_total objects made visible
# TYPE kvpool_puts_total counter
kvpool_puts_total 1210.0
# HELP kvpool_put_failures_total refused puts by reason
# TYPE kvpool_put_failures_total counter
kvpool_put_failures_total{reason="no_space"} 2.0
kvpool_put_failures_total{reason="write_conflict"} 1.0
# HELP kvpool_evictions_total objects evicted
# TYPE kvpool_evictions_total counter
kvpool_evictions_total{tier="memory"} 7.0
# HELP kvpool_request_errors_total error replies
# TYPE kvpool_request_errors_total counter
kvpool_request_errors_total{code="NO_SPACE",op="PutStart"} 2.0
kvpool_request_errors_total{code="NO_SPACE",op="BatchPutStart"} 1.0
"""


def screen(snapshot: PoolSnapshot, width: int = 140, **kw: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(render(snapshot, **kw))
    return out.getvalue()


def test_ratio_text_always_has_its_denominator() -> None:
    assert Ratio(300, 800, "blocks").text() == "37.5% (300 of 800 blocks)"
    assert Ratio(0, 12, "gets").text() == "0.0% (0 of 12 gets)"
    # nothing asked is not "0 %": it says so
    assert Ratio(0, 0, "blocks").text() == "— (no blocks asked yet)"
    assert Ratio(0, 0, "blocks").value is None


def test_parse_collects_status_and_metrics() -> None:
    snap = parse_snapshot("m:1", STATUS, METRICS)
    assert snap.get_hits == Ratio(300, 800, "gets")
    assert snap.prefix_blocks == Ratio(16, 64, "blocks")
    assert snap.prefix_tokens == Ratio(256, 1024, "tokens")
    assert snap.puts == 1210
    assert snap.put_failures == {"no_space": 2, "write_conflict": 1}
    assert snap.evictions == {"memory": 7}
    assert snap.errors == {"NO_SPACE": 3}  # summed over ops
    assert [t.name for t in snap.tiers] == ["memory", "ssd"]
    assert snap.tiers[0].fraction == 0.75 and snap.tiers[1].fraction is None
    assert snap.offloads == 5 and snap.offload_failures == 1
    as_json = json.loads(json.dumps(snap.to_json()))
    assert as_json["get_hits"] == {"hits": 300, "total": 800, "unit": "gets", "ratio": 0.375}


def test_render_shows_every_fact() -> None:
    text = screen(parse_snapshot("10.0.0.1:50088", STATUS, METRICS))
    assert "kvpool 10.0.0.1:50088" in text and "1,200 objects (2 being written)" in text
    assert "3.0 GiB" in text and "4.0 GiB" in text and "75.0%" in text  # memory tier
    assert "no capacity" in text  # the SSD tier is off
    assert "37.5% (300 of 800 gets)" in text
    assert "25.0% (16 of 64 blocks)" in text
    assert "25.0% (256 of 1,024 tokens)" in text
    assert "1,210" in text  # puts
    assert "3 (no_space 2, write_conflict 1)" in text
    assert "7 (memory 7)" in text  # evictions
    assert "5 (1 failed)" in text  # offloads
    assert "node-p0" in text and "0.8 s ago" in text and "node-d0" in text and "45.0 s ago" in text
    assert "NO_SPACE: no memory segment can hold 9 bytes" in text
    assert "rates" not in text  # no previous snapshot, no rates
    assert "flags: eviction_high_watermark_ratio=0.9" in text


def test_render_empty_pool_says_so() -> None:
    status = dict(STATUS, clients=[], recent_errors=[], lookups=dict.fromkeys(STATUS["lookups"], 0))
    text = screen(parse_snapshot("m:1", status, ""))
    assert "no client registered" in text
    assert "— (no gets asked yet)" in text and "— (no blocks asked yet)" in text
    assert "No recent errors" in text


def test_render_shows_each_memory_segments_warmth_with_progress() -> None:
    gib = 2**30
    segments = [
        {"segment_id": "node-p0/mem", "client_id": "node-p0", "capacity": 4 * gib,
         "used": gib, "warm": "warming", "warmed_bytes": 3 * gib // 2},
        {"segment_id": "node-d0/mem", "client_id": "node-d0", "capacity": gib,
         "used": 0, "warm": "warm", "warmed_bytes": gib},
        {"segment_id": "node-d1/mem", "client_id": "node-d1", "capacity": gib,
         "used": 0, "warm": "off", "warmed_bytes": 0},
    ]  # fmt: skip
    snap = parse_snapshot("m:1", dict(STATUS, segments=segments), METRICS)
    assert [s.warm for s in snap.segments] == ["warming", "warm", "off"]
    text = screen(snap)
    assert "Memory segments" in text
    assert "warming 38% (1.5 GiB of 4.0 GiB)" in text
    assert "off (each page faults on first touch)" in text
    assert json.loads(json.dumps(snap.to_json()))["segments"][0]["warmed_bytes"] == 3 * gib // 2
    # a master that reports no segments (older): no table, nothing else changes
    assert "Memory segments" not in screen(parse_snapshot("m:1", STATUS, METRICS))


def test_rates_between_two_snapshots() -> None:
    first = parse_snapshot("m:1", STATUS, METRICS)
    second = parse_snapshot(
        "m:1",
        dict(STATUS, uptime_s=135.0, lookups=dict(STATUS["lookups"], gets=1000.0)),
        METRICS.replace("kvpool_puts_total 1210.0", "kvpool_puts_total 1260.0"),
    )
    rate = rates(first, second)
    assert rate is not None
    assert (rate.puts_per_s, rate.gets_per_s, rate.evictions_per_s) == (5.0, 20.0, 0.0)
    assert "5.0 puts/s · 20.0 gets/s" in screen(second, rate=rate)
    assert rates(second, first) is None  # a restarted master: no negative rates


@pytest.mark.parametrize(
    ("status", "metrics"),
    [
        ({"uptime_s": 1}, ""),  # not a kvpool snapshot
        (dict(STATUS, tiers=[1, 2]), ""),
        (STATUS, "kvpool_puts_total not-a-number\n"),
    ],
)
def test_parse_rejects_what_is_not_a_master(status: dict[str, Any], metrics: str) -> None:
    with pytest.raises(ProtocolError):
        parse_snapshot("m:1", status, metrics)


# ------------------------------------------------------------------ a real master
@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    with start_master("--segment_size", "1MB", "--client_ttl", "30") as proc:
        with Client(proc.address, timeout_s=30) as c:
            for i in range(30):  # 1.5 MB into 1 MB: the oldest are evicted
                c.put(f"status-{i}", bytes([i]) * 50_000)
            for i in range(26, 34):  # 4 hits, 4 misses
                with contextlib.suppress(ObjectNotFound):
                    c.get(f"status-{i}")
            c.prefix_lookup([f"status-{i}" for i in range(26, 34)])  # 4 of 8 blocks
        yield proc


def test_status_of_a_real_master(pool: PoolProcess) -> None:
    out = io.StringIO()
    assert run(StatusOptions(master=pool.address), out=out) == 0
    text = out.getvalue()
    assert f"kvpool {pool.address}" in text
    assert "50.0% (4 of 8 gets)" in text
    assert "50.0% (4 of 8 blocks)" in text
    assert "master/mem" in text  # the master's own segment, with its heartbeat
    assert "segment_size=1048576" in text  # the flags it runs with
    assert "evictions" in text and "(memory " in text

    snap = fetch_snapshot(pool.address)
    assert snap.puts == 30
    assert snap.get_hits == Ratio(4, 8, "gets")
    assert sum(snap.evictions.values()) > 0
    mem = next(t for t in snap.tiers if t.name == "memory")
    assert mem.capacity == 1 << 20 and 0 < mem.used <= mem.capacity
    assert mem.objects == snap.objects < 30


def test_status_json_and_watch(pool: PoolProcess) -> None:
    out = io.StringIO()
    sleeps: list[float] = []
    assert (
        run(
            StatusOptions(master=pool.address, watch_s=0.5, as_json=True, max_updates=3),
            out=out,
            sleep=sleeps.append,
        )
        == 0
    )
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3 and sleeps == [0.5, 0.5]
    assert lines[-1]["get_hits"] == {"hits": 4.0, "total": 8.0, "unit": "gets", "ratio": 0.5}
    assert lines[-1]["puts"] == 30


def test_status_command_line(pool: PoolProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "status", "--master", pool.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "50.0% (4 of 8 gets)" in done.stdout


def test_default_master_comes_from_the_node_config(tmp_path: Path) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text('{"local_hostname": "10.0.0.2", "metadata_server": "10.0.0.1:50099"}')
    assert default_master({"KVPOOL_CONFIG_PATH": str(config)}) == "10.0.0.1:50099"
    assert default_master({"MOONCAKE_CONFIG_PATH": str(config)}) == "10.0.0.1:50099"
    assert default_master({}) == "127.0.0.1:50088"
    config.write_text("{not json")
    assert default_master({"KVPOOL_CONFIG_PATH": str(config)}) == "127.0.0.1:50088"


def test_status_command_finds_the_master_in_the_node_config(
    pool: PoolProcess, tmp_path: Path
) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": pool.address}))
    env = {k: v for k, v in os.environ.items() if not k.endswith("CONFIG_PATH")}
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(env, KVPOOL_CONFIG_PATH=str(config)),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["master"] == pool.address


def test_unreachable_master_is_a_clear_error() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(TransferError):
        fetch_snapshot(address, timeout_s=2)
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "status", "--master", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"cannot read the master at {address}" in done.stderr
    assert "is `kvpool master` running there?" in done.stderr
    assert done.stdout == ""


def test_something_else_on_the_port_is_not_a_master(pool: PoolProcess) -> None:
    # an HTTP server that is not a kvpool master answers 404: a clear error, not a crash
    with pytest.raises(ProtocolError, match="HTTP 404"):
        fetch_snapshot(f"{pool.address}/nowhere")
