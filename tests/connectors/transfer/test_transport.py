"""The data-plane seam: the worker moves pages only through a KVTransport.

A third, in-process transport (pages copied between two workers' caches in one process)
shows the seam is the whole contract: the worker's pulls, holds and PullDones work over
it unchanged.  Which transport the node config chooses is tested here; kvpool's TCP and
Mooncake's Transfer Engine themselves are tested side by side in test_transports.py.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np
import pytest

from kvpool.config.kv_transfer import TransferConfig
from kvpool.connectors.pages import PagedCaches
from kvpool.connectors.transfer.engine import EngineTransport
from kvpool.connectors.transfer.jobs import HoldJob, ReleaseJob, TransferJobs
from kvpool.connectors.transfer.pull_port import PullPort
from kvpool.connectors.transfer.tcp import TcpPullTransport
from kvpool.connectors.transfer.transport import (
    TRANSPORTS,
    PeerUnreachable,
    PullHandler,
    make_transport,
)
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from kvpool.errors import ConfigError, TransferError
from kvpool.protocol.pull import PULL_REPLY_CODEC, PULL_REQUEST_CODEC, Pull, PullDone
from kvpool.security.peer import PeerSettings
from tests.connectors.transfer.helpers import LAYERS, caches, config, recv_job, wait_results


class Fabric:
    """Addresses of the in-process transports, like a network."""

    def __init__(self) -> None:
        self.peers: dict[tuple[str, int], LoopbackTransport] = {}


class LoopbackLink:
    def __init__(self, peer: LoopbackTransport, mine: PagedCaches) -> None:
        self._peer, self._mine = peer, mine

    def __enter__(self) -> LoopbackLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    def pull(self, pull: Pull, block_ids: Sequence[int], dst_start: int, deadline: float) -> int:
        handler, src = self._peer.handler, self._peer.caches
        assert handler is not None and src is not None
        reason = handler.admit(pull, deadline)
        if reason is not None:
            raise TransferError(f"prefill refused: {reason}")
        total = 0
        for name in pull.layers:
            for src_block, dst_block in zip(pull.block_ids, block_ids, strict=True):
                page = src.page(name, src_block, pull.head_start, pull.head_count)
                self._mine.page(name, dst_block, dst_start, pull.head_count)[:] = page
                total += len(page)
        handler.served(pull, total)
        return total

    def done(self, message: PullDone, deadline: float) -> None:
        assert self._peer.handler is not None
        self._peer.handler.done(message)


class LoopbackTransport:
    name = "loopback"

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.caches: PagedCaches | None = None
        self.handler: PullHandler | None = None
        self.connects = 0

    def register(self, caches: PagedCaches) -> None:
        self.caches = caches

    def serve(self, host: str, port: int, handler: PullHandler) -> None:
        self.handler = handler
        self.fabric.peers[(host, port)] = self

    def connect(self, host: str, port: int, timeout_s: float) -> LoopbackLink:
        self.connects += 1
        peer = self.fabric.peers.get((host, port))
        if peer is None:
            raise PeerUnreachable(f"nothing serves {host}:{port}")
        assert self.caches is not None
        return LoopbackLink(peer, self.caches)

    def close(self) -> None:
        self.fabric.peers = {k: v for k, v in self.fabric.peers.items() if v is not self}


@pytest.fixture
def pair() -> Iterator[tuple[TransferWorker, TransferWorker, dict, dict, LoopbackTransport]]:
    fabric = Fabric()
    d_transport = LoopbackTransport(fabric)
    p = TransferWorker(
        config("kv_producer", 30000), RankInfo(0, 1, 0, 2), transport=LoopbackTransport(fabric)
    )
    d = TransferWorker(config("kv_consumer", 30100), RankInfo(0, 1, 0, 2), transport=d_transport)
    p_caches, p_kv = caches(2, seed=5)
    d_caches, d_kv = caches(2, seed=None)
    p.register(p_caches)
    d.register(d_caches)
    yield p, d, p_kv, d_kv, d_transport
    p.close()
    d.close()


def test_a_second_transport_carries_pulls_unchanged(pair: tuple) -> None:
    p, d, p_kv, d_kv, d_transport = pair
    p.submit(TransferJobs(holds=[HoldJob("p-r", (5, 2))]))
    d.submit(TransferJobs(recvs=[recv_job("r", [0, 1], [5, 2], 30000)]))
    assert wait_results(d, want_recv="r").failed_recving == set()
    for name in LAYERS:
        np.testing.assert_array_equal(d_kv[name][[0, 1]], p_kv[name][[5, 2]])
    assert "p-r" in wait_results(p, want_send="p-r").finished_sending
    assert d.take_counts()["pulls"] == 1 and p.take_counts()["served_pulls"] == 1
    assert d_transport.connects == 1


def test_pull_done_over_a_second_transport_frees_the_hold(pair: tuple) -> None:
    p, d, _, _, _ = pair
    p.submit(TransferJobs(holds=[HoldJob("p-x", (1,))]))
    d.submit(TransferJobs(releases=[ReleaseJob("x", "p-x", "127.0.0.1", 30000, 1)]))
    assert "p-x" in wait_results(p, want_send="p-x").finished_sending
    assert d.results().finished_recving == set()  # a PullDone is not a load


def test_an_unreachable_peer_is_a_failed_load_without_a_pull_done(pair: tuple) -> None:
    _, d, _, _, d_transport = pair
    d.submit(TransferJobs(recvs=[recv_job("gone", [3], [1], 31000)]))
    assert wait_results(d, want_recv="gone").failed_recving == {"gone"}
    assert d.take_load_errors() == {3}
    assert d_transport.connects == 1  # no second connection to send a PullDone


def test_tcp_is_the_default_and_the_engine_takes_rdma_and_the_switch() -> None:
    cfg: TransferConfig = config("kv_consumer", 30100)
    transport = make_transport(cfg)
    assert isinstance(transport, TcpPullTransport) and transport.name == "tcp"
    assert isinstance(make_transport(replace(cfg, transport="kvpool")), TcpPullTransport)
    # nothing of Mooncake starts until the caches are registered (in a namespace)
    for changed in (replace(cfg, protocol="rdma"), replace(cfg, transport="transfer_engine")):
        engine = make_transport(changed)
        assert isinstance(engine, EngineTransport)
        assert engine.name == f"{changed.protocol} (Mooncake Transfer Engine)"
    assert set(TRANSPORTS) == {
        ("kvpool", "tcp"),
        ("transfer_engine", "tcp"),
        ("transfer_engine", "rdma"),
    }
    with pytest.raises(ConfigError, match=r"^protocol: .*'rdma' with transport 'kvpool'"):
        make_transport(replace(cfg, protocol="rdma", transport="kvpool"))
    with pytest.raises(ConfigError, match=r"^protocol: .*'carrier'"):
        make_transport(replace(cfg, protocol="carrier"))


def test_a_pull_port_takes_its_settings_whole_and_refuses_tls() -> None:
    """Both transports' pull port is made from the rank's PeerSettings; kv_port carries no
    TLS, so settings with a TLS context are refused rather than silently dropped."""
    plain = PullPort(
        requests=PULL_REQUEST_CODEC,
        replies=PULL_REPLY_CODEC,
        peer=PeerSettings(5.0, None, "decode e1"),
        move=lambda conn, pull, deadline: 0,
    )
    plain.close()  # never listened: nothing to close
    with pytest.raises(ConfigError, match=r"^kv_port: .*no TLS"):
        PullPort(
            requests=PULL_REQUEST_CODEC,
            replies=PULL_REPLY_CODEC,
            peer=PeerSettings(5.0, tls=ssl.create_default_context()),
            move=lambda conn, pull, deadline: 0,
        )
