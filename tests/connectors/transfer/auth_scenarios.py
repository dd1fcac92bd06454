"""Credential scenarios on the prefill's ``kv_port``, for either transport (see scenarios.py).

Each builds a real P and real D workers, each with its own secret file (or none), and
returns plain values: which loads failed, what D's error said, how many connections P
refused, and whether a D holding the right secret was still served afterwards.  The
environment is never read (``env={}``): the secret comes from the config's
``secret_file``, as a node config gives it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvpool.config.kv_transfer import TransferConfig
from kvpool.config.topology import Topology
from kvpool.connectors.transfer.jobs import HoldJob, TransferJobs
from kvpool.connectors.transfer.transport import make_transport
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from kvpool.errors import KVPoolError
from kvpool.protocol.pull import Pull
from kvpool.security.credentials import Credential
from tests.connectors.transfer.helpers import (
    BLOCK,
    LAYERS,
    ROW,
    caches,
    free_port,
    recv_job,
    wait_results,
)


def _cfg(transport: str, role: str, port: int, secret_file: str) -> TransferConfig:
    return TransferConfig(
        role=role,
        kv_port=port,
        engine_id="group-a",
        peer=Topology(1, 1),
        transport=transport,
        connect_timeout_ms=10000,
        transfer_timeout_ms=10000,
        hold_timeout_ms=60000,
        secret_file=secret_file,
    )


def _worker(cfg: TransferConfig, seed: int | None) -> tuple[TransferWorker, dict[str, Any]]:
    worker = TransferWorker(cfg, RankInfo(0, 1, 0, 2), env={})
    paged, arrays = caches(2, seed)
    worker.register(paged)
    return worker, arrays


def _raw_pull_error(transport: str, port: int, secret_file: str) -> str:
    """D's own words when it pulls a held request by hand (the transport's error)."""
    cfg = _cfg(transport, "kv_consumer", port + 100, secret_file)
    credential = None
    if secret_file:
        from kvpool.security.secret import read_secret_file

        credential = read_secret_file(secret_file, "secret_file")
    d = make_transport(cfg, credential)
    d_caches, _ = caches(2, seed=None)
    d.register(d_caches)
    pull = Pull("p-raw", [1], 0, 2, list(LAYERS), 0, 1, 2 * BLOCK * ROW, "group-a")
    try:
        with d.connect("127.0.0.1", port, 2.0) as link:
            link.pull(pull, [0], 0, time.monotonic() + 3)
    except KVPoolError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        d.close()
    return "no error"


def credentials(transport: str, p_secret: str, d_secret: str, good_secret: str) -> dict[str, Any]:
    """P runs with ``p_secret`` ("" none); a D with ``d_secret`` pulls request a, then
    (when P has a secret) a D with ``good_secret`` pulls request b from the same P."""
    port = free_port()
    made: list[TransferWorker] = []
    try:
        p, p_kv = _worker(_cfg(transport, "kv_producer", port, p_secret), seed=7)
        made.append(p)
        p.submit(TransferJobs(holds=[HoldJob("p-a", (1, 2)), HoldJob("p-b", (3, 4))]))
        p.submit(TransferJobs(holds=[HoldJob("p-raw", (1,))]))
        d, d_kv = _worker(_cfg(transport, "kv_consumer", port + 100, d_secret), seed=None)
        made.append(d)
        started = time.monotonic()
        d.submit(TransferJobs(recvs=[recv_job("a", [0, 1], [1, 2], port)]))
        first = wait_results(d, want_recv="a")
        elapsed = time.monotonic() - started
        out: dict[str, Any] = {
            "failed": first.failed_recving,
            "load_errors": d.take_load_errors(),
            "a_equal": all(np.array_equal(d_kv[n][[0, 1]], p_kv[n][[1, 2]]) for n in LAYERS),
            "elapsed": elapsed,
            "raw_error": _raw_pull_error(transport, port, d_secret),
        }
        if p_secret:
            good, good_kv = _worker(
                _cfg(transport, "kv_consumer", port + 200, good_secret), seed=None
            )
            made.append(good)
            good.submit(TransferJobs(recvs=[recv_job("b", [5, 6], [3, 4], port)]))
            second = wait_results(good, want_recv="b")
            sent = wait_results(p, want_send="p-b")
            out["good_failed"] = second.failed_recving
            out["b_equal"] = all(
                np.array_equal(good_kv[n][[5, 6]], p_kv[n][[3, 4]]) for n in LAYERS
            )
            out["b_sent"] = "p-b" in sent.finished_sending
        out["refused_auth"] = p._transport.refused_auth  # type: ignore[attr-defined]
        return out
    finally:
        for worker in made:
            worker.close()


def flooded(transport: str, secret: str, flood: int) -> dict[str, Any]:
    """P with ``secret`` while a peer with no credential holds ``flood`` idle and
    ``flood`` slow-handshake connections on its kv_port; a D with the secret pulls."""
    from kvpool.testing.flood import FloodProcess

    port = free_port()
    made: list[TransferWorker] = []
    try:
        p, p_kv = _worker(_cfg(transport, "kv_producer", port, secret), seed=3)
        made.append(p)
        p.submit(TransferJobs(holds=[HoldJob("p-f", (1, 2))]))
        with FloodProcess(f"127.0.0.1:{port}", idle=flood, slow=flood) as flooder:
            flooder.wait_opened(2 * flood)
            d, d_kv = _worker(_cfg(transport, "kv_consumer", port + 100, secret), seed=None)
            made.append(d)
            d.submit(TransferJobs(recvs=[recv_job("f", [0, 1], [1, 2], port)]))
            got = wait_results(d, want_recv="f")
            return {
                "failed": got.failed_recving,
                "load_errors": d.take_load_errors(),
                "equal": all(np.array_equal(d_kv[n][[0, 1]], p_kv[n][[1, 2]]) for n in LAYERS),
                "refused": p._transport.refused_auth,  # type: ignore[attr-defined]
            }
    finally:
        for worker in made:
            worker.close()


def node_credential_cannot_pull(transport: str, p_secret: str, node_cred: str) -> str:
    """A storage node's own credential is no decode's: D's error text."""
    port = free_port()
    p, _ = _worker(_cfg(transport, "kv_producer", port, p_secret), seed=1)
    try:
        p.submit(TransferJobs(holds=[HoldJob("p-raw", (1,))]))
        return _raw_pull_error(transport, port, node_cred)
    finally:
        p.close()


def make_credential_text(secret: str, node_id: str) -> str:
    """A node's credential derived from ``secret`` (as ``kvpool secret node-key``)."""
    return Credential.parse(secret, "test").node_credential(node_id)
