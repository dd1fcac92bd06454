"""What the handshake costs: connect + handshake against connect alone, and a request
after it against the same request on an open connection without one.

    python bench/auth.py [--rounds 400]

Rows, each the median of ``--rounds`` tries on loopback, and its ratio to its baseline
of the same run:

    data: connect                 TCP connect + close to a node's data server (baseline)
    data: connect + handshake     the same with the handshake (role data) before the close
    data: connect + 1st read      a new connection and its first 4 KiB read (baseline)
    data: connect + auth + 1st    the same to a data server with a secret
    data: 4 KiB read, plain       one read on an open connection, server without a secret
    data: 4 KiB read, after auth  the same on an authenticated connection (per-frame cost)
    master: connect               TCP connect + close to ``kvpool master`` (baseline)
    master: connect + handshake   the same with the handshake (role client)

The data servers run in a process of their own, as a node's; the master is a real
``kvpool master`` process.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from kvpool.datapath.data_ops import read_into
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.net import split_address
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from kvpool.security.socket_auth import authenticate
from kvpool.storage.segment import Segment
from kvpool.testing.processes import start_master

SECRET = Credential.parse(os.urandom(32).hex(), "bench")


def _medians_us(
    a: Callable[[], object], b: Callable[[], object], rounds: int
) -> tuple[float, float]:
    """Median µs of ``a`` and of ``b``, run in turns (so drift and warm-up hit both)."""
    for _ in range(min(rounds // 10, 50)):  # warm up
        a()
        b()
    times: tuple[list[int], list[int]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - start)
    return statistics.median(times[0]) / 1000, statistics.median(times[1]) / 1000


def _connect(address: tuple[str, int]) -> None:
    socket.create_connection(address, timeout=5).close()


def _handshake(address: tuple[str, int], role: str) -> None:
    sock = socket.create_connection(address, timeout=5)
    try:
        authenticate(sock, SECRET, role, "bench", 5.0, "bench")
    finally:
        sock.close()


def _serve_data(secret: bytes, conn: Connection) -> None:
    """In a process of its own, as a node's: a plain and a secured data server."""
    segment = Segment.create(1 << 20)
    plain = SegmentServer()
    secured = SegmentServer(credential=Credential(secret=secret), server_id="node-bench")
    for server in (plain, secured):
        server.add_segment("seg", segment)
        server.start()
    conn.send((plain.address, secured.address))
    conn.recv()  # until the bench is done
    plain.close()
    secured.close()
    segment.close()


def _data_rows(rounds: int) -> list[tuple[str, float, float]]:
    ours, theirs = multiprocessing.Pipe()
    peer = multiprocessing.get_context("spawn").Process(
        target=_serve_data, args=(SECRET.secret, theirs), daemon=True
    )
    peer.start()
    try:
        if not ours.poll(30):
            raise RuntimeError("the data server process did not start")
        plain, secured = ours.recv()
        base, auth = _medians_us(
            lambda: _connect(plain), lambda: _handshake(secured, "data"), rounds
        )
        buf = bytearray(4096)

        def first_read(address: tuple[str, int], credential: Credential | None) -> None:
            with SegmentConnection(
                *address, PeerSettings(credential=credential, client_id="b")
            ) as conn:
                read_into(conn, "seg", 0, buf)

        first_plain, first_auth = _medians_us(
            lambda: first_read(plain, None), lambda: first_read(secured, SECRET), rounds
        )
        with (
            SegmentConnection(*plain) as p,
            SegmentConnection(*secured, PeerSettings(credential=SECRET, client_id="b")) as s,
        ):
            read_plain, read_auth = _medians_us(
                lambda: read_into(p, "seg", 0, buf), lambda: read_into(s, "seg", 0, buf), rounds * 5
            )
    finally:
        ours.send("stop")
        peer.join(10)
    return [
        ("data: connect", base, base),
        ("data: connect + handshake", auth, base),
        ("data: connect + 1st read, plain", first_plain, first_plain),
        ("data: connect + auth + 1st read", first_auth, first_plain),
        ("data: 4 KiB read, plain", read_plain, read_plain),
        ("data: 4 KiB read, after auth", read_auth, read_plain),
    ]


def _master_rows(rounds: int) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "secret"
        path.write_text(SECRET.secret.decode())
        path.chmod(0o600)
        with start_master("--segment_size", "0", "--secret_file", str(path)) as master:
            address = split_address(master.address)
            base, auth = _medians_us(
                lambda: _connect(address), lambda: _handshake(address, "client"), rounds
            )
    return [("master: connect", base, base), ("master: connect + handshake", auth, base)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args(argv)
    rows = _data_rows(args.rounds) + _master_rows(args.rounds)
    print(f"{'row':32} {'median µs':>10} {'× baseline':>11}")
    for name, value, baseline in rows:
        print(f"{name:32} {value:10.1f} {value / baseline:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
