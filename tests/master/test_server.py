"""The master as a real process on 127.0.0.1: RPC and HTTP on one port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvpool.client.client import Client
from kvpool.config import MasterConfig
from kvpool.errors import (
    NoSpace,
    ObjectBusy,
    ObjectNotFound,
    Overloaded,
    PeerTimeout,
    ProtocolError,
)
from kvpool.master.server import MasterServer
from kvpool.protocol import messages as m
from kvpool.protocol.codec import MAGIC
from kvpool.storage.ssd import files_by_key, header_size, object_path
from kvpool.testing.processes import PoolProcess, start_master
from tests.pool_support import ssd_flags, tiers_of
from tests.waiting import wait_until


def http_get(proc: PoolProcess, path: str) -> str:
    with urllib.request.urlopen(f"http://{proc.address}{path}", timeout=5) as r:
        body: bytes = r.read()
        return body.decode()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_put_get_exists_remove_round_trip(client: Client) -> None:
    value = os.urandom(100_000)
    assert not client.exists("a")
    client.put("a", value)
    assert client.exists("a")
    assert client.get("a") == value
    assert client.batch_exists(["a", "b"]) == [True, False]
    assert client.prefix_lookup(["a", "b", "a"]) == 1
    assert client.remove("a")
    assert not client.remove("a")
    with pytest.raises(ObjectNotFound):
        client.get("a")


def test_zero_copy_forms_accept_numpy_and_report_sizes(client: Client) -> None:
    src = np.arange(4096, dtype=np.float32)
    client.put_from("arr", src)
    dst = np.zeros(8192, dtype=np.float32)
    assert client.get_into("arr", dst) == src.nbytes
    assert np.array_equal(dst[:4096], src)
    sizes = client.batch_get_into(["arr", "nope"], [np.zeros(4096, np.float32)] * 2)
    assert sizes == [src.nbytes, -1]
    assert client.batch_get(["arr", "nope"])[1] is None


def test_batch_put_writes_all_in_two_round_trips_and_reports_per_key(client: Client) -> None:
    client.put("old", b"stored before")
    keys = ["b0", "b1", "old", "huge"]
    values = [b"zero", os.urandom(70_000), b"ignored", bytes(9 << 20)]  # huge > segment
    results = client.batch_put(keys, values)
    assert results[:3] == [None, None, None]
    assert isinstance(results[3], NoSpace)
    assert client.get("b1") == values[1]
    assert client.get("old") == b"stored before"
    assert not client.exists("huge")


def test_duplicate_put_keeps_the_first_value(client: Client) -> None:
    client.put("k", b"first")
    client.put("k", b"other")
    assert client.get("k") == b"first"


def test_the_guides_metrics_check_shows_blocks_and_clients(
    master: PoolProcess, client: Client
) -> None:
    client.put("x", b"1" * 1000)
    client.put("y", b"2" * 1000)
    # the production guide's §8.1 check, as written
    out = subprocess.run(
        f'curl -s http://{master.address}/metrics | grep -E "kv_cache|connected"',
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert metric(out, "kvpool_kv_cache_blocks_total") == 2
    # the master's own segment owner and this test's client connection
    assert metric(out, "kvpool_connected_clients") == 2
    text = http_get(master, "/metrics")
    assert metric(text, "kvpool_tier_used_bytes") > 0
    assert "kvpool_request_seconds_bucket" in text
    assert '"status": "ok"' in http_get(master, "/health")


def test_hits_are_counted_with_their_denominator(master: PoolProcess, client: Client) -> None:
    client.put("h", b"v")
    client.get("h")
    with pytest.raises(ObjectNotFound):
        client.get("miss")
    client.prefix_lookup(["h", "miss"], tokens_per_key=16)
    text = http_get(master, "/metrics")
    assert metric(text, 'kvpool_lookups_total{kind="get"}') == 2
    assert metric(text, 'kvpool_hits_total{kind="get",tier="memory"}') == 1
    assert metric(text, 'kvpool_prefix_tokens_total{result="queried"}') == 32
    assert metric(text, 'kvpool_prefix_tokens_total{result="hit"}') == 16


def test_full_pool_of_evictable_objects_accepts_puts(client: Client) -> None:
    block = os.urandom(1 << 20)
    for i in range(20):  # 20 MiB into an 8 MiB segment
        client.put(f"b{i}", block)
    assert client.get("b19") == block
    assert client.stats()["stats"]["evictions"] >= 12


def test_all_leased_pool_refuses_puts_until_leases_expire() -> None:
    with (
        start_master("--segment_size", "2MiB", "--default_kv_lease_ttl", "300") as proc,
        Client(proc.address) as c,
    ):
        c.put("a", b"a" * (1 << 20))
        c.put("b", b"b" * (1 << 20))
        assert c.pin(["a", "b"], "reader", ttl_ms=300) == 2
        with pytest.raises(NoSpace):
            c.put("c", b"c" * (1 << 20))
        with pytest.raises(ObjectBusy):
            c.remove("a")
        for _ in range(100):  # bounded: the pins run out after 300 ms
            try:
                c.put("c", b"c" * (1 << 20))
                break
            except NoSpace:
                time.sleep(0.05)
        assert c.get("c") == b"c" * (1 << 20)


def _raw(proc: PoolProcess) -> socket.socket:
    s = socket.create_connection((proc.host, proc.port), timeout=5)
    return s


def test_malformed_frames_get_errors_and_the_master_keeps_serving(
    master: PoolProcess, client: Client
) -> None:
    # bad magic after the sniffer chose RPC: a frame header with an absurd body length
    s = _raw(master)
    s.sendall(MAGIC + struct.pack("!II", 1 << 30, 0))
    reply, _ = m.MASTER_REPLY_CODEC.decode_header(s.recv(12)), None
    s.close()
    assert reply.body_length > 0
    # an unknown message type: an error reply, and the same connection still works
    s = _raw(master)
    body = b"\x81\xa4type\xa7Unknown"
    s.sendall(MAGIC + struct.pack("!II", len(body), 0) + body)
    header = m.MASTER_REPLY_CODEC.decode_header(s.recv(12))
    err = m.MASTER_REPLY_CODEC.decode_body(s.recv(header.body_length))
    assert isinstance(err, m.Error) and err.code == ProtocolError.code
    frame = m.MASTER_REQUEST_CODEC.encode(m.Exists("nothing"))
    s.sendall(frame)
    header = m.MASTER_REPLY_CODEC.decode_header(s.recv(12))
    assert m.MASTER_REPLY_CODEC.decode_body(s.recv(header.body_length)) == m.Bools([False])
    s.close()
    # a client that disconnects mid-frame
    s = _raw(master)
    s.sendall(frame[:7])
    s.close()
    # garbage that is neither RPC nor HTTP
    s = _raw(master)
    s.sendall(b"\x00\x01\x02\x03garbage\r\n\r\n")
    s.recv(100)
    s.close()
    client.put("still", b"serving")
    assert client.get("still") == b"serving"


def test_a_connection_that_never_speaks_is_closed_and_others_are_served(
    master: PoolProcess, client: Client
) -> None:
    from kvpool.master.server import SNIFF_TIMEOUT_S

    s = _raw(master)
    s.settimeout(SNIFF_TIMEOUT_S + 10)
    client.put("meanwhile", b"served")  # the silent one holds nothing up
    assert s.recv(1) == b""  # closed by the master, after its deadline (else: a timeout)
    s.close()
    assert client.get("meanwhile") == b"served"


def test_mooncakes_master_command_line_is_accepted_as_written(tmp_path: object) -> None:
    flags = [
        "--eviction_high_watermark_ratio",
        "0.9",
        "--eviction_ratio",
        "0.1",
        "--default_kv_lease_ttl",
        "11000",
        "--enable_offload=true",
        "--client_ttl=120",
        f"--ssd-offload-path={tmp_path}",
        "--ssd_offload_limit",
        "64MiB",
    ]
    with start_master(*flags) as proc:
        assert '"status": "ok"' in http_get(proc, "/health")
        config = json.loads(http_get(proc, "/api/status"))["config"]
        assert config["enable_offload"] is True and config["client_ttl"] == 120
        assert config["default_kv_lease_ttl"] == 11000
    assert proc.proc.returncode == 0  # SIGTERM is a clean shutdown


def test_bad_flag_values_name_the_flag() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "master", "--eviction_ratio", "1.5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--eviction_ratio" in done.stderr


# ------------------------------------------------------------- its own SSD tier, restarted
def fill_ssd(ssd: Path, *, kill: bool) -> tuple[dict[str, bytes], list[str]]:
    """Run a master until most of 40 objects sit on its SSD; stop (or SIGKILL) it."""
    values = {f"r{i:02d}": os.urandom(64 * 1024) for i in range(40)}  # 2.5 MiB
    master = start_master(*ssd_flags(ssd))
    try:
        with Client(master.address) as c:
            for key, value in values.items():
                c.put(key, value)
            on_ssd = sorted(k for k, t in tiers_of(c, list(values)).items() if t == "ssd")
    finally:
        if kill:
            master.kill()
        else:
            assert master.stop() == 0
    assert len(on_ssd) >= 20  # 1 MiB of memory holds at most 16 of them
    # the tick's watermark round may have demoted a few more since: the files are what
    # the tier held when the master stopped
    on_disk = sorted(k for k in files_by_key(ssd) if k.startswith("r"))
    assert set(on_ssd) <= set(on_disk)
    return values, on_disk


def test_master_serves_its_previous_ssd_objects_after_a_restart(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    values, on_ssd = fill_ssd(ssd, kill=False)
    with start_master(*ssd_flags(ssd)) as master, Client(master.address) as c:
        line = master.wait_for_line(r"restored \d+ SSD objects", 10)
        size = 64 * 1024 * len(on_ssd)
        assert f"restored {len(on_ssd)} SSD objects ({size} bytes), dropped 0" in line
        assert set(tiers_of(c, on_ssd).values()) == {"ssd"}
        for key in on_ssd:
            assert c.get(key) == values[key]
        snap = c.stats()
        assert snap["tiers"]["ssd"]["objects"] == len(on_ssd)
        assert snap["tiers"]["ssd"]["used"] == size
        assert not any(c.batch_exists([k for k in values if k not in on_ssd]))  # memory's
        # the restored tier keeps working: new objects push old ones to SSD and back out
        more = {f"m{i:02d}": os.urandom(64 * 1024) for i in range(40)}
        for key, value in more.items():
            c.put(key, value)
        for key, value in (values | more).items():
            try:
                got = c.get(key)
            except ObjectNotFound:
                continue  # evicted to make room: a miss, fine
            assert got == value
        # no file is left that the index does not know (a leak) or vice versa
        files = set(files_by_key(ssd))
        assert files == {k for k, t in tiers_of(c, list(values | more)).items() if t == "ssd"}


def test_corrupt_ssd_files_across_a_master_restart_are_misses_and_deleted(
    tmp_path: Path,
) -> None:
    ssd = tmp_path / "ssd"
    values, on_ssd = fill_ssd(ssd, kill=True)
    bad_header, bad_value, *intact = on_ssd
    for key, at in ((bad_header, 2), (bad_value, header_size(bad_value) + 4096)):
        path = object_path(ssd, key)
        raw = bytearray(path.read_bytes())
        raw[at] ^= 0x5A
        path.write_bytes(raw)
    with start_master(*ssd_flags(ssd)) as master, Client(master.address) as c:
        master.wait_for_line(rf"restored {len(intact) + 1} SSD objects \(\d+ bytes\), dropped 1")
        assert not c.exists(bad_header)  # its header failed: never announced
        assert not object_path(ssd, bad_header).exists()
        with pytest.raises(ObjectNotFound):
            c.get(bad_value)  # its value failed: a miss, never the wrong bytes
        assert not object_path(ssd, bad_value).exists()
        for key in intact:
            assert c.get(key) == values[key]
        # both are counted where an operator looks
        with urllib.request.urlopen(f"http://{master.address}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert "kvpool_ssd_bad_files 1.0" in text.splitlines()
        assert "kvpool_ssd_corrupt_reads 1.0" in text.splitlines()


# -- what a peer can make the master hold (issue 11, item 3) ---------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _reply_then_eof(s: socket.socket) -> m.Error:
    """The one error reply the master sends before closing, then the close itself."""
    s.settimeout(10)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    header = m.MASTER_REPLY_CODEC.decode_header(data[:12])
    err = m.MASTER_REPLY_CODEC.decode_body(data[12 : 12 + header.body_length])
    assert isinstance(err, m.Error)
    return err


def test_a_payload_announced_to_the_master_is_refused_from_the_header(
    master: PoolProcess, client: Client
) -> None:
    client.put("warm", b"x" * 1000)  # the master's own steady state before measuring
    before = rss_bytes(master.pid)
    socks = []
    for _ in range(2):
        s = _raw(master)
        body = msgspec.msgpack.encode(m.Exists("k"))
        s.sendall(MAGIC + struct.pack("!II", len(body), 1 << 30) + body)
        try:  # what a peer would stream after such a header: the master must not keep it
            for _ in range(64):
                s.sendall(b"\0" * (1 << 20))
        except OSError:
            pass  # refused and closed: what we want
        socks.append(s)
    for s in socks:
        err = _reply_then_eof(s)
        assert err.code == ProtocolError.code and "payload" in err.message
        s.close()
    assert rss_bytes(master.pid) - before < 4 << 20
    client.put("after", b"still serving")
    assert client.get("after") == b"still serving"


@pytest.fixture
def inproc_master() -> Iterator[MasterServer]:
    """A master in this process (its limits set small by the test), on its own loop."""
    server = MasterServer(MasterConfig(port=0, segment_size=0))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _exists_frame(keys: int) -> bytes:
    return m.MASTER_REQUEST_CODEC.encode(m.BatchExists([f"key-{i:08d}" for i in range(keys)]))


def test_unfinished_requests_of_all_connections_share_one_bound(
    inproc_master: MasterServer,
) -> None:
    inproc_master.rpc_buffers.limit = 1 << 20
    big = _exists_frame(60_000)  # ~900 KiB: under the limit alone, not twice
    assert (1 << 19) < len(big) < (1 << 20)
    a = socket.create_connection(("127.0.0.1", inproc_master.port), timeout=10)
    a.sendall(big[:-1])
    wait_until(lambda: inproc_master.rpc_buffers.held >= len(big) - 13, what="a's body held")
    b = socket.create_connection(("127.0.0.1", inproc_master.port), timeout=10)
    b.sendall(big[:-1])
    err = _reply_then_eof(b)
    assert err.code == Overloaded.code and "retry" in err.message
    b.close()
    a.sendall(big[-1:])  # the first one completes and is answered
    header = m.MASTER_REPLY_CODEC.decode_header(_recv_exactly(a, 12))
    reply = m.MASTER_REPLY_CODEC.decode_body(_recv_exactly(a, header.body_length))
    assert reply == m.Bools([False] * 60_000)
    a.close()
    wait_until(lambda: inproc_master.rpc_buffers.held == 0, what="nothing held")


def test_a_request_trickled_past_the_frame_timeout_is_dropped(
    inproc_master: MasterServer,
) -> None:
    inproc_master.rpc_frame_timeout_s = 0.2
    s = socket.create_connection(("127.0.0.1", inproc_master.port), timeout=10)
    frame = _exists_frame(100)
    s.sendall(frame[: len(frame) // 2])
    err = _reply_then_eof(s)
    assert err.code == PeerTimeout.code and "incomplete" in err.message
    s.close()
    wait_until(lambda: inproc_master.rpc_buffers.held == 0, what="nothing held")


def test_a_peer_that_never_reads_its_replies_is_not_answered_forever(
    inproc_master: MasterServer,
) -> None:
    inproc_master.rpc_frame_timeout_s = 0.2
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", inproc_master.port))
    frame = _exists_frame(2000)  # each reply is ~2 KiB; the peer reads none of them
    s.settimeout(10)
    sent = 0
    with contextlib.suppress(OSError):  # closed under us: what we want
        while sent < 4096:  # bounded: 4096 requests could buffer 8 MiB of replies
            s.sendall(frame)
            sent += 1
    wait_until(lambda: inproc_master.service.rpc_connections == 0, what="the master let go")
    assert inproc_master.rpc_buffers.held == 0
    s.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "closed early"
        data += chunk
    return data


# A master signalled the moment it says "listening" (what a supervisor waits for) must stop
# cleanly.  The signal is raised from inside start() itself, after the line is logged, so
# the race the handlers lost once (they went in after start()) is hit every time.
_SIGNAL_AT_LISTENING = """
import asyncio, os, signal, sys
from kvpool.config import MasterConfig
from kvpool.master.server import MasterServer

class Server(MasterServer):
    async def start(self):
        await super().start()
        os.kill(os.getpid(), signal.SIGTERM)

server = Server(MasterConfig(port=0, segment_size=0))
asyncio.run(server.serve_until_signal())
print("stopped cleanly", flush=True)
sys.exit(server.exit_code)
"""


def test_a_master_signalled_as_it_says_listening_stops_cleanly() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_AT_LISTENING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "stopped cleanly" in done.stdout
