"""What the handshake costs: connect + handshake against connect alone, and a request
after it against the same request on an open connection without one.

    python bench/auth.py [--rounds 400]

Rows, each the median of ``--rounds`` tries on loopback, and its ratio to its baseline
of the same run:

    data: connect                 TCP connect + close to a node's data server (baseline)
    data: connect + handshake     the same with the handshake (role data) before the close
    data: 4 KiB read, plain       one read on an open connection, server without a secret
    data: 4 KiB read, after auth  the same on an authenticated connection (per-frame cost)
    master: connect               TCP connect + close to ``kvpool master`` (baseline)
    master: connect + handshake   the same with the handshake (role client)

The data server runs in this process (its threads); the master is a real process.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvpool.core.credentials import Credential
from kvpool.net import split_address
from kvpool.storage.segment import Segment
from kvpool.testing.processes import start_master
from kvpool.transfer.auth import authenticate
from kvpool.transfer.segment_client import SegmentConnection
from kvpool.transfer.segment_server import SegmentServer

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


def _data_rows(rounds: int) -> list[tuple[str, float, float]]:
    segment = Segment.create(1 << 20)
    plain = SegmentServer()
    secured = SegmentServer(credential=SECRET, server_id="node-bench")
    for server in (plain, secured):
        server.add_segment("seg", segment)
        server.start()
    try:
        base, auth = _medians_us(
            lambda: _connect(plain.address), lambda: _handshake(secured.address, "data"), rounds
        )
        buf = bytearray(4096)
        with (
            SegmentConnection(*plain.address) as p,
            SegmentConnection(*secured.address, credential=SECRET, client_id="b") as s,
        ):
            read_plain, read_auth = _medians_us(
                lambda: p.read_into("seg", 0, buf), lambda: s.read_into("seg", 0, buf), rounds * 5
            )
    finally:
        plain.close()
        secured.close()
        segment.close()
    return [
        ("data: connect", base, base),
        ("data: connect + handshake", auth, base),
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
