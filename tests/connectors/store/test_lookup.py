from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool.connectors.store.lookup import (
    LOOKUP_CODEC,
    REPLY_CODEC,
    Failed,
    Found,
    Lookup,
    LookupClient,
    LookupServer,
    channel_path,
)
from kvpool.datapath import framing
from kvpool.engines import PoolEngine, PoolLookups
from kvpool.errors import TransferError
from kvpool.protocol.codec import Codec
from tests.connectors.store.fake_pool import FakePool

LOG = logging.getLogger("test")


@contextmanager
def lookup_server(tmp_path: Path, objects: dict[str, bytes]) -> Iterator[tuple[FakePool, str]]:
    """A lookup server over a fake pool holding ``objects``: (the pool, its socket path)."""
    pool = FakePool()
    pool.objects.update(objects)
    path = str(tmp_path / "ch.sock")
    server = LookupServer(path, pool, LOG)
    try:
        yield pool, path
    finally:
        server.close()


def test_channel_names_differ_per_instance_even_with_equal_engine_ids(tmp_path: Path) -> None:
    p = channel_path(
        instance_id="1", engine_id="pd-0", dp_rank=0, lookup_rpc_port=0, root=str(tmp_path)
    )
    d = channel_path(
        instance_id="2", engine_id="pd-0", dp_rank=0, lookup_rpc_port=0, root=str(tmp_path)
    )
    again = channel_path(
        instance_id="1", engine_id="pd-0", dp_rank=0, lookup_rpc_port=0, root=str(tmp_path)
    )
    assert p != d and p == again
    # short where it really lives (sun_path is 108 bytes); a test's tmp_path (under
    # pytest-xdist, one folder deeper) says nothing about that
    default = channel_path(instance_id="1", engine_id="pd-0", dp_rank=0, lookup_rpc_port=0)
    assert len(default) < 108 and len(os.path.basename(p)) == len(os.path.basename(default))


def test_lookup_round_trip_and_worker_errors(tmp_path: Path) -> None:
    with lookup_server(tmp_path, {"a": b"1", "b": b"2"}) as (pool, path):
        client = LookupClient(path, timeout_s=5)
        assert client.prefix_lookup(["a", "b", "c"]) == 2
        assert client.prefix_lookup(["c", "a"]) == 0
        # The scheduler pins its hits over the same channel, and ends them there.
        assert client.pin(["a", "c", "b"], "req-1", 0) == 2 and pool.pinned() == {"a", "b"}
        assert client.release("req-1") == 2 and pool.pinned() == set()
        pool.down = True
        with pytest.raises(TransferError, match="PeerTimeout"):
            client.prefix_lookup(["a"])
        pool.down = False
        assert client.prefix_lookup(["a"]) == 1  # the connection survived the error
        client.close()
        # Junk on another connection does not take the server down.
        with socket.socket(socket.AF_UNIX) as junk:
            junk.connect(path)
            junk.sendall(struct.pack("<I", 1 << 30))
        second = LookupClient(path, timeout_s=5)
        assert second.prefix_lookup(["a"]) == 1
        second.close()
    assert not Path(path).exists()
    with pytest.raises(TransferError, match="not reachable"):
        LookupClient(path, timeout_s=1)


def test_the_channel_answers_which_keys_the_pool_holds(tmp_path: Path) -> None:
    """A hybrid model's lookup needs every chunk of every KV cache group, not a leading
    run: the channel answers batch_exists in one round trip."""
    with lookup_server(tmp_path, {"a": b"1", "c": b"3"}) as (pool, path):
        client = LookupClient(path, timeout_s=5)
        assert client.batch_exists(["a", "b", "c", "d"]) == [True, False, True, False]
        assert client.batch_exists([]) == []
        calls = pool.calls["batch_exists"]
        assert client.batch_exists(["c"] * 1000) == [True] * 1000
        assert pool.calls["batch_exists"] == calls + 1
        pool.down = True
        with pytest.raises(TransferError, match="Probe failed in the worker"):
            client.batch_exists(["a"])
        client.close()


def test_the_channel_speaks_kvpools_frames(tmp_path: Path) -> None:
    with lookup_server(tmp_path, {"a": b"1"}) as (_, path):
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(path)
            # A frame of the right shape whose body is not a Lookup is answered, not fatal.
            wrong = Codec(Found)
            reply, _ = framing.call(raw, wrong, REPLY_CODEC, Found(1), timeout_s=5)
            assert isinstance(reply, Failed) and "ProtocolError" in reply.message
            reply, _ = framing.call(raw, LOOKUP_CODEC, REPLY_CODEC, Lookup(["a", "b"]), 5)
            assert reply == Found(1)
        with socket.socket(socket.AF_UNIX) as raw:  # another protocol: the server hangs up
            raw.connect(path)
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
            raw.settimeout(5)
            try:
                hung_up = raw.recv(1) == b""
            except ConnectionResetError:  # closed with our bytes unread
                hung_up = True
            assert hung_up
        client = LookupClient(path, timeout_s=5)
        assert client.prefix_lookup(["a"]) == 1 and client.engine == "embedded"
        # the scheduler half's part of a pool, and only that: it moves nothing
        assert isinstance(client, PoolLookups) and not isinstance(client, PoolEngine)
        client.close()
