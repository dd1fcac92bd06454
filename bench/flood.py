"""Throughput of each secured port with and without a flood from a peer that has no
credential, in the same run.

    .venv/bin/python bench/flood.py [--flood 2000] [--seconds 5]

A real secured pool (a ``kvpool master`` with no segment of its own and one ``kvpool
node``, both on 127.0.0.1 with a cluster secret) and a P rank's ``kv_port`` (kvpool's TCP
transport, in this process).  Per port, the same bounded work is timed twice: first
quiet, then while ``python -m kvpool.testing.flood`` holds ``--flood`` idle and ``--flood``
slow-handshake connections on that port (re-opening what is closed).  Rows:

- ``node data port``  64 KiB puts then gets of the same keys through a client (TCP), MB/s;
- ``master RPC``      ``exists`` calls, per second;
- ``master HTTP``     ``GET /metrics`` with the operator's token, per second;
- ``kv_port``         a decode's pull of a request's pages from P, pulls per second.

Errors are counted, never retried.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

OBJECT = 64 << 10


def _rate(work: Callable[[int], int], seconds: float) -> tuple[float, int]:
    """Units of ``work(i)`` per second for about ``seconds`` (bounded), and errors."""
    done = errors = 0
    start = time.perf_counter()
    for i in range(1_000_000):
        if time.perf_counter() - start > seconds:
            break
        try:
            done += work(i)
        except Exception:  # counted: the row says how many
            errors += 1
    return done / (time.perf_counter() - start), errors


def _flooded(address: str, flood: int, work: Callable[[int], int], seconds: float) -> tuple:
    from kvpool.testing.flood import FloodProcess

    quiet = _rate(work, seconds)
    with FloodProcess(address, idle=flood, slow=flood) as flooder:
        flooder.wait_opened(2 * flood)
        loud = _rate(work, seconds)
    return quiet, loud


def _pool_rows(flood: int, seconds: float) -> list[tuple[str, str, tuple, tuple]]:
    from kvpool.client.client import Client
    from kvpool.net import http_get
    from kvpool.security.credentials import Credential
    from tests.master.auth_pool import SECRET, secured_pool

    rows = []
    token = Credential.parse(SECRET, "k").operator_token()
    with (
        tempfile.TemporaryDirectory() as tmp,
        secured_pool(Path(tmp), node_size="256MiB") as p,
        Client(p.master.address, credential=SECRET, allow_shm=False, timeout_s=10) as c,
    ):
        data = b"x" * OBJECT
        keys = itertools.count()

        def put_get(i: int) -> int:
            key = f"k{next(keys)}"
            c.put(key, data)
            if c.get(key) != data:
                raise RuntimeError(f"{key}: wrong bytes")
            return 2 * OBJECT

        def exists(i: int) -> int:
            c.exists(f"k{i}")
            return 1

        def metrics(i: int) -> int:
            headers = {"Authorization": f"Bearer {token}"}
            reply = http_get(f"http://{p.master.address}/metrics", 10, headers=headers)
            if not reply.ok:
                raise RuntimeError(reply.error)
            return 1

        for name, unit, address, work in (
            ("node data port", "MB/s", p.data_address, put_get),
            ("master RPC", "calls/s", p.master.address, exists),
            ("master HTTP", "GETs/s", p.master.address, metrics),
        ):
            quiet, loud = _flooded(address, flood, work, seconds)
            if unit == "MB/s":
                quiet, loud = (quiet[0] / 1e6, quiet[1]), (loud[0] / 1e6, loud[1])
            rows.append((name, unit, quiet, loud))
    return rows


def _kv_port_row(flood: int, seconds: float) -> tuple[str, str, tuple, tuple]:
    from kvpool.connectors.transfer.jobs import HoldJob, TransferJobs
    from tests.connectors.transfer import auth_scenarios
    from tests.connectors.transfer.helpers import free_port, recv_job, wait_results

    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_text(_SECRET + "\n")
        secret.chmod(0o600)
        port = free_port()
        p, _ = auth_scenarios._worker(
            auth_scenarios._cfg("kvpool", "kv_producer", port, str(secret)), seed=3
        )
        d, _ = auth_scenarios._worker(
            auth_scenarios._cfg("kvpool", "kv_consumer", port + 100, str(secret)), seed=None
        )
        try:

            def pull(i: int) -> int:
                p.submit(TransferJobs(holds=[HoldJob(f"p-{i}", (1, 2))]))
                d.submit(TransferJobs(recvs=[recv_job(f"{i}", [0, 1], [1, 2], port)]))
                got = wait_results(d, want_recv=f"{i}")
                if got.failed_recving:
                    raise RuntimeError("the pull failed")
                return 1

            quiet, loud = _flooded(f"127.0.0.1:{port}", flood, pull, seconds)
        finally:
            d.close()
            p.close()
    return ("kv_port (kvpool TCP)", "pulls/s", quiet, loud)


_SECRET = "0f6c1d7e5a9b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=2000, help="idle and slow, each")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    args = parser.parse_args(argv)
    rows = [*_pool_rows(args.flood, args.seconds), _kv_port_row(args.flood, args.seconds)]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# bench/flood.py, {when}, {platform.node()}, {args.flood} idle + {args.flood} slow")
    print(f"{'port':22} {'unit':8} {'quiet':>10} {'flooded':>10} {'ratio':>6} {'errors':>7}")
    for name, unit, (quiet, qerr), (loud, lerr) in rows:
        ratio = loud / quiet if quiet else 0.0
        print(f"{name:22} {unit:8} {quiet:10.1f} {loud:10.1f} {ratio:6.2f} {qerr + lerr:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
