"""What TLS costs on a node's data port: put/get throughput with and without it, in the
same run, and the price of a new connection (TCP connect + TLS handshake).

    python bench/tls.py [--rounds 20] [--connects 200]

Rows: a write (put) and a read (get) of 64 KiB, 1 MiB and 16 MiB on an open connection
to a plain data server and to one with TLS (MiB/s, the median of ``--rounds`` tries, and
the TLS/plain ratio); then connect + first 4 KiB read, plain, with TLS, and with TLS and
the kvpool handshake inside (median µs, ratio to plain).  The data servers run in a
process of their own, as a node's, with a throwaway CA made by ``openssl``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import ssl
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._timing import median_s
from kvpool.datapath.data_ops import read_into, write
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from kvpool.security.tls import TLSConfig
from kvpool.storage.segment import Segment
from kvpool.testing.tls import CertAuthority

SIZES = (64 << 10, 1 << 20, 16 << 20)
SECRET = Credential.parse(os.urandom(32).hex(), "bench")


def _serve(cert: str, key: str, secret: bytes, conn: Connection) -> None:
    """In a process of its own: a plain, a TLS, and a TLS + secret data server."""
    segment = Segment.create(64 << 20)
    tls = TLSConfig(cert, key).server_context()
    servers = [
        SegmentServer(),
        SegmentServer(tls=tls),
        SegmentServer(tls=tls, credential=Credential(secret=secret), server_id="node-bench"),
    ]
    for server in servers:
        server.add_segment("seg", segment)
        server.start()
    conn.send([s.address for s in servers])
    conn.recv()  # until the bench is done
    for server in servers:
        server.close()
    segment.close()


def _throughput_rows(
    plain: tuple[str, int], secure: tuple[str, int], ctx: ssl.SSLContext, rounds: int
) -> list[tuple[str, float, float, float]]:
    rows = []
    with SegmentConnection(*plain) as p, SegmentConnection(*secure, PeerSettings(tls=ctx)) as t:
        for size in SIZES:
            data = memoryview(os.urandom(size))
            into = bytearray(size)
            mib = size / (1 << 20)
            name = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
            puts = (
                lambda c=p, d=data: write(c, "seg", 0, d),
                lambda c=t, d=data: write(c, "seg", 0, d),
            )
            gets = (
                lambda c=p, b=into: read_into(c, "seg", 0, b),
                lambda c=t, b=into: read_into(c, "seg", 0, b),
            )
            for verb, (on_plain, on_tls) in (("put", puts), ("get", gets)):
                tp = median_s(on_plain, rounds)
                tt = median_s(on_tls, rounds)
                label = f"{verb} {name}"
                rows.append((label, mib / tp, mib / tt, tp / tt))
    return rows


def _connect_rows(
    addresses: list[tuple[str, int]], ctx: ssl.SSLContext, rounds: int
) -> list[tuple[str, float, float]]:
    buf = bytearray(4096)

    def first_read(address: tuple[str, int], **kw: object) -> None:
        with SegmentConnection(*address, PeerSettings(client_id="b", **kw)) as conn:  # type: ignore[arg-type]
            read_into(conn, "seg", 0, buf)

    plain, secure, both = addresses
    base = median_s(lambda: first_read(plain), rounds) * 1e6
    tls = median_s(lambda: first_read(secure, tls=ctx), rounds) * 1e6
    auth = median_s(lambda: first_read(both, tls=ctx, credential=SECRET), rounds) * 1e6
    return [
        ("connect + 1st read, plain", base, 1.0),
        ("connect + TLS + 1st read", tls, tls / base),
        ("connect + TLS + auth + 1st", auth, auth / base),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--connects", type=int, default=200)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ca = CertAuthority.create(Path(tmp))
        server = ca.issue("server")
        ctx = TLSConfig(ca=ca.cert).client_context()
        assert ctx is not None
        ours, theirs = multiprocessing.Pipe()
        peer = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(server.cert, server.key, SECRET.secret, theirs), daemon=True
        )
        peer.start()
        try:
            if not ours.poll(30):
                raise RuntimeError("the data server process did not start")
            addresses = ours.recv()
            rows = _throughput_rows(addresses[0], addresses[1], ctx, args.rounds)
            connects = _connect_rows(addresses, ctx, args.connects)
        finally:
            ours.send("stop")
            peer.join(10)
    print(f"{'row':28} {'plain MiB/s':>12} {'TLS MiB/s':>10} {'TLS/plain':>10}")
    for name, plain, secure, ratio in rows:
        print(f"{name:28} {plain:12.0f} {secure:10.0f} {ratio:10.2f}")
    print(f"{'row':28} {'median µs':>12} {'× plain':>10}")
    for name, value, ratio in connects:
        print(f"{name:28} {value:12.0f} {ratio:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
