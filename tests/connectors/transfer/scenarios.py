"""Transfer scenarios that run on either transport, here or inside a network namespace.

Each function builds real workers (P and D in one process), drives them, and returns
what the test asserts on (arrays, result sets, counts, error texts): plain picklable
values, so the same function runs in the test process (kvpool's TCP) or in a
:class:`~kvpool.testing.mooncake.Namespace` helper (the Transfer Engine binds every
interface, so it only runs there), and the test's assertions are the same for both.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvpool.config.kv_transfer import TransferConfig
from kvpool.connectors.transfer.jobs import HoldJob, ReleaseJob, TransferJobs
from kvpool.connectors.transfer.transport import make_transport
from kvpool.connectors.transfer.worker import TransferWorker
from kvpool.datapath.framing import BadRequest
from kvpool.errors import KVPoolError
from kvpool.protocol.engine_pull import Unread
from kvpool.protocol.pull import Pull
from tests.connectors.transfer.helpers import (
    BLOCK,
    LAYERS,
    POLL_S,
    ROW,
    caches,
    config,
    free_port,
    recv_job,
    start,
    wait_results,
)

ENGINE = "transfer_engine"  # the node config's "transport" value for the Transfer Engine


def _cfg(transport: str, role: str, port: int, peer_tp: int = 1, **extra: int) -> TransferConfig:
    return replace(config(role, port, peer_tp, **extra), transport=transport)


class _Workers:
    def __init__(self) -> None:
        self.made: list[TransferWorker] = []

    def __enter__(self) -> list[TransferWorker]:
        return self.made

    def __exit__(self, *exc: object) -> None:
        for worker in self.made:
            worker.close()


def pull_pages(transport: str) -> dict[str, Any]:
    """P holds three blocks, D pulls two of them into other block ids."""
    port = free_port()
    with _Workers() as made:
        p, p_kv = start(made, _cfg(transport, "kv_producer", port), 0, 1, 2, seed=1)
        d, d_kv = start(made, _cfg(transport, "kv_consumer", port + 100), 0, 1, 2, seed=None)
        p.submit(TransferJobs(holds=[HoldJob("p-r1", (5, 2, 7))]))
        d.submit(TransferJobs(recvs=[recv_job("r1", [0, 1], [5, 2], port)]))
        res = wait_results(d, want_recv="r1")
        sent = wait_results(p, want_send="p-r1")
        return {
            "name": d._transport.name,
            "failed": res.failed_recving,
            "load_errors": d.take_load_errors(),
            "got": {n: d_kv[n].copy() for n in LAYERS},
            "sent": {n: p_kv[n][[5, 2]].copy() for n in LAYERS},
            "finished_sending": sent.finished_sending,
            "held": p.num_held,
            "d_counts": d.take_counts(),
            "p_counts": p.take_counts(),
        }


def adjacent_blocks(transport: str) -> dict[str, Any]:
    """Blocks back to back on both sides (the engine moves each run in one request)."""
    port = free_port()
    with _Workers() as made:
        p, p_kv = start(made, _cfg(transport, "kv_producer", port), 0, 1, 2, seed=2)
        d, d_kv = start(made, _cfg(transport, "kv_consumer", port + 100), 0, 1, 2, seed=None)
        p.submit(TransferJobs(holds=[HoldJob("p-run", (2, 3, 4, 7))]))
        d.submit(TransferJobs(recvs=[recv_job("run", [4, 5, 6, 0], [2, 3, 4, 7], port)]))
        res = wait_results(d, want_recv="run")
        return {
            "failed": res.failed_recving,
            "got": {n: d_kv[n][[4, 5, 6, 0]].copy() for n in LAYERS},
            "sent": {n: p_kv[n][[2, 3, 4, 7]].copy() for n in LAYERS},
            "untouched": all(not d_kv[n][[1, 2, 3, 7]].any() for n in LAYERS),
        }


def heterogeneous(transport: str, p_tp: int, d_tp: int, heads: int = 4) -> dict[str, Any]:
    """Every D rank pulls its heads from the P ranks that hold them (dst_start)."""
    port = free_port(p_tp)
    with _Workers() as made:
        prefill = [
            start(made, _cfg(transport, "kv_producer", port, d_tp), r, p_tp, heads, seed=10 + r)
            for r in range(p_tp)
        ]
        decode = [
            start(made, _cfg(transport, "kv_consumer", port + 100, p_tp), r, d_tp, heads, None)
            for r in range(d_tp)
        ]
        for p, _ in prefill:
            p.submit(TransferJobs(holds=[HoldJob("p-x", (3, 4))]))
        for d, _ in decode:
            d.submit(TransferJobs(recvs=[recv_job("x", [6, 1], [3, 4], port, tp=p_tp)]))
        failed = set()
        for d, _ in decode:
            failed |= wait_results(d, want_recv="x").failed_recving
        sent = set()
        for p, _ in prefill:
            sent |= wait_results(p, want_send="p-x").finished_sending
        # the full head axis, as one model would hold it, on both sides
        return {
            "failed": failed,
            "finished_sending": sent,
            "full_p": {
                n: np.concatenate([kv[n][[3, 4]] for _, kv in prefill], axis=1) for n in LAYERS
            },
            "full_d": {
                n: np.concatenate([kv[n][[6, 1]] for _, kv in decode], axis=1) for n in LAYERS
            },
            "untouched": all(
                not kv[n][[0, 2, 3, 4, 5, 7]].any() for _, kv in decode for n in LAYERS
            ),
        }


def refusal(transport: str) -> str:
    """A pull of blocks P does not hold for the request: P's reason, as D's error says it."""
    port = free_port()
    with _Workers() as made:
        p, _ = start(made, _cfg(transport, "kv_producer", port), 0, 1, 2, seed=1)
        p.submit(TransferJobs(holds=[HoldJob("p-bad", (1, 2))]))
        d_transport = make_transport(_cfg(transport, "kv_consumer", port + 100))
        d_caches, _ = caches(2, seed=None)
        d_transport.register(d_caches)
        pull = Pull("p-bad", [1, 3], 0, 2, list(LAYERS), 0, 1, 2 * BLOCK * ROW, "group-a")
        try:
            with d_transport.connect("127.0.0.1", port, 2.0) as link:
                link.pull(pull, [0, 1], 0, time.monotonic() + 5)
        except KVPoolError as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            d_transport.close()
    return "no error"


def dead_prefill(transport: str) -> dict[str, Any]:
    """Nothing listens on P's port: a failed load, at once; the raw connect's error too."""
    port = free_port()
    with _Workers() as made:
        d, _ = start(made, _cfg(transport, "kv_consumer", port + 100), 0, 1, 2, seed=None)
        started = time.monotonic()
        d.submit(TransferJobs(recvs=[recv_job("dead", [2, 3], [0, 1], port)]))
        res = wait_results(d, want_recv="dead")
        elapsed = time.monotonic() - started
        try:
            d._transport.connect("127.0.0.1", port, 1.0)
            error = "connected"
        except KVPoolError as exc:
            error = type(exc).__name__
        return {
            "failed": res.failed_recving,
            "load_errors": d.take_load_errors(),
            "counts": d.take_counts(),
            "elapsed": elapsed,
            "connect_error": error,
        }


def silent_prefill(transport: str) -> dict[str, Any]:
    """P's port accepts and never answers: the pull times out instead of hanging."""
    port = free_port()
    silent = socket.create_server(("127.0.0.1", port))
    silent.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        with _Workers() as made:
            cfg = _cfg(transport, "kv_consumer", port + 100, transfer=300)
            d, _ = start(made, cfg, 0, 1, 2, seed=None)
            started = time.monotonic()
            d.submit(TransferJobs(recvs=[recv_job("hung", [1], [1], port)]))
            res = wait_results(d, want_recv="hung")
            return {
                "failed": res.failed_recving,
                "load_errors": d.take_load_errors(),
                "elapsed": time.monotonic() - started,
            }
    finally:
        stop.set()
        thread.join(2)
        silent.close()
        for s in accepted:
            s.close()


def pull_done(transport: str) -> dict[str, Any]:
    """D will not pull: its PullDone frees P's hold at once, and is no load."""
    port = free_port()
    with _Workers() as made:
        p, _ = start(made, _cfg(transport, "kv_producer", port), 0, 1, 2, seed=1)
        d, _ = start(made, _cfg(transport, "kv_consumer", port + 100), 0, 1, 2, seed=None)
        p.submit(TransferJobs(holds=[HoldJob("p-rel", (0,))]))
        d.submit(TransferJobs(releases=[ReleaseJob("rel", "p-rel", "127.0.0.1", port, 1)]))
        sent = wait_results(p, want_send="p-rel").finished_sending
        return {
            "finished_sending": sent,
            "recving": d.results().finished_recving,
            "held": p.num_held,
        }


def engine_gone(transport: str) -> dict[str, Any]:
    """P admits the pull but its Transfer Engine is gone: D's read fails at once, D tells
    P (Unread), and the worker frees P's hold with a PullDone.  P here is a stand-in
    speaking the engine pull's control conversation."""
    from kvpool.datapath.framing import recv_request, send_frame
    from kvpool.protocol.engine_pull import ENGINE_REPLY_CODEC, ENGINE_REQUEST_CODEC, Pages
    from kvpool.protocol.pull import Done

    port, gone = free_port(), free_port()
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(POLL_S)
    heard: list[str] = []

    def prefill() -> None:
        for _ in range(2):  # the pull, then the worker's PullDone
            try:
                conn = server.accept()[0]
            except OSError:
                return
            with conn:
                got = recv_request(conn, ENGINE_REQUEST_CODEC, 5.0, idle_timeout=5.0)
                while got is not None and not isinstance(got, BadRequest):
                    message = got[0]
                    heard.append(type(message).__name__)
                    deadline = time.monotonic() + 5
                    if isinstance(message, Pull):
                        pages = Pages(
                            f"127.0.0.1:{gone}", [4096, 8192], 2 * BLOCK * ROW, BLOCK * ROW
                        )
                        send_frame(conn, ENGINE_REPLY_CODEC, pages, None, deadline)
                    elif not isinstance(message, Unread):
                        send_frame(conn, ENGINE_REPLY_CODEC, Done(0), None, deadline)
                    got = recv_request(conn, ENGINE_REQUEST_CODEC, 5.0, idle_timeout=5.0)

    thread = threading.Thread(target=prefill, daemon=True)
    thread.start()
    try:
        with _Workers() as made:
            d, d_kv = start(made, _cfg(transport, "kv_consumer", port + 100), 0, 1, 2, seed=None)
            started = time.monotonic()
            d.submit(TransferJobs(recvs=[recv_job("gone", [1], [1], port)]))
            res = wait_results(d, want_recv="gone")
            elapsed = time.monotonic() - started
            thread.join(POLL_S)
            return {
                "failed": res.failed_recving,
                "load_errors": d.take_load_errors(),
                "elapsed": elapsed,
                "heard": heard,
                "untouched": not any(kv.any() for kv in d_kv.values()),
            }
    finally:
        server.close()
