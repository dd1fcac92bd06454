"""Shared pieces of the transfer worker tests: small caches, configs, polling like vLLM."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.config.kv_transfer import TransferConfig
from kvpool.config.topology import Topology
from kvpool.connectors.pages import PagedCaches
from kvpool.connectors.transfer.jobs import RecvJob
from kvpool.connectors.transfer.worker import RankInfo, TransferResults, TransferWorker
from kvpool.net import free_port_runs
from tests.waiting import wait_until

if TYPE_CHECKING:  # the scenarios import this module inside a namespace, without pytest
    import pytest

    from kvpool.testing.mooncake import Namespace

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 8
BLOCK = 4
ROW = 16  # bytes of one token row of one head (k and v)
POLL_S = 60.0  # bound for a result to show up (a loaded CI machine); a correct run takes ms


def free_port(span: int = 1) -> int:
    """A base port with ``span`` free ports from it."""
    return free_port_runs("127.0.0.1", [span])[0]


def caches(heads: int, seed: int | None) -> tuple[PagedCaches, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    arrays = {
        name: (
            rng.integers(0, 256, (NUM_BLOCKS, heads, BLOCK, ROW), dtype=np.uint8)
            if seed is not None
            else np.zeros((NUM_BLOCKS, heads, BLOCK, ROW), dtype=np.uint8)
        )
        for name in LAYERS
    }
    return PagedCaches(arrays), arrays


def config(role: str, port: int, peer_tp: int | None = 1, **extra: int) -> TransferConfig:
    return TransferConfig(
        role=role,
        kv_port=port,
        engine_id="group-a",
        peer=None if peer_tp is None else Topology(1, peer_tp),
        connect_timeout_ms=extra.get("connect", 2000),
        transfer_timeout_ms=extra.get("transfer", 5000),
        hold_timeout_ms=extra.get("hold", 60000),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def start(
    workers: list[TransferWorker],
    cfg: TransferConfig,
    rank: int,
    tp: int,
    heads: int,
    seed: int | None,
    clock: Clock | None = None,
) -> tuple[TransferWorker, dict[str, np.ndarray]]:
    worker = TransferWorker(cfg, RankInfo(rank, tp, 0, heads), clock or time.monotonic)
    paged, arrays = caches(max(1, heads // tp), seed)
    worker.register(paged)
    workers.append(worker)
    return worker, arrays


def wait_results(
    worker: TransferWorker, want_recv: str | None = None, want_send: str | None = None
) -> TransferResults:
    """Poll like vLLM's engine loop does, until the wanted request shows up."""
    seen = TransferResults(set(), set(), set())

    def arrived() -> bool:
        r = worker.results()
        seen.finished_sending.update(r.finished_sending)
        seen.finished_recving.update(r.finished_recving)
        seen.failed_recving.update(r.failed_recving)
        return (want_recv is None or want_recv in seen.finished_recving) and (
            want_send is None or want_send in seen.finished_sending
        )

    wait_until(arrived, POLL_S, interval_s=0.005, what=f"a result for {want_recv or want_send}")
    return seen


def recv_job(rid: str, local: list[int], remote: list[int], port: int, tp: int = 1) -> RecvJob:
    return RecvJob(rid, tuple(local), tuple(remote), "p-" + rid, "127.0.0.1", port, tp, "group-a")


Run = Callable[..., Any]


def on_transport(request: pytest.FixtureRequest, scenarios: ModuleType) -> Run:
    """``run("scenario", *args)``: that function of ``scenarios`` on the transport in
    ``request.param``, kvpool's TCP in this process or the Transfer Engine in the
    ``namespace`` fixture's network namespace (a failure there shows its log: the
    engine's own log says why)."""
    transport: str = request.param
    if transport == "kvpool":
        return lambda name, *args: getattr(scenarios, name)(transport, *args)
    ns: Namespace = request.getfixturevalue("namespace")

    def in_namespace(name: str, *args: Any) -> Any:
        try:
            return ns.run(f"{scenarios.__name__}:{name}", transport, *args)
        except Exception as exc:
            raise AssertionError(f"{exc}\n--- namespace log ---\n{ns.log}") from exc

    return in_namespace
