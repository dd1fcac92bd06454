"""The store connector's lookup channel (the embedded backend's ``lookup_rpc_port`` socket)
fed random and mutated frames.

After every example, on a fresh connection: a real :class:`LookupClient` gets the right
count of leading keys the pool holds.  The hostile connection must end in well-formed
replies and a close once the peer half-closes, and the worker's thread must not fail
(an unhandled exception in a thread fails the test: pytest turns the warning into an
error here).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.connectors.store.lookup import REPLY_CODEC, LookupClient, LookupServer
from kvpool.engines import PoolEngine
from tests.fuzz.frames import FUZZ_SOCKET, mutated_frames
from tests.fuzz.peer import decode_replies, send_and_close
from tests.fuzz.wires import WIRES

pytestmark = pytest.mark.timeout(240)

LOOKUP_WIRE = next(w for w in WIRES if w.name == "lookup-request")
HELD = {"b0", "b1", "b2"}


def leading(keys: list[str]) -> int:
    count = 0
    for key in keys:
        if key not in HELD:
            break
        count += 1
    return count


class HeldPool:
    """The part of a pool the lookup channel asks (prefix lookups, pins, releases); it
    holds exactly :data:`HELD`."""

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return leading(list(keys))

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        return sum(key in HELD for key in keys)

    def release(self, owner: str) -> int:
        return 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LookupServer]:
    path = tmp_path_factory.mktemp("lookup") / "l.sock"
    pool = cast(PoolEngine, HeldPool())
    srv = LookupServer(str(path), pool, logging.getLogger("test.lookup"))
    yield srv
    srv.close()


@FUZZ_SOCKET
@given(frame=mutated_frames(LOOKUP_WIRE, strings=st.sampled_from(sorted(HELD)) | st.text()))
def test_any_frame_leaves_the_lookup_channel_answering(server: LookupServer, frame: bytes) -> None:
    outcome = send_and_close(server.path, frame)
    assert outcome.closed, f"the lookup channel held a half-closed connection after {frame!r}"
    decode_replies(outcome.received, REPLY_CODEC)
    assert Path(server.path).exists()
    client = LookupClient(server.path, timeout_s=10)
    try:
        assert client.prefix_lookup(["b0", "b1", "x", "b2"]) == 2
        assert client.prefix_lookup(["b0", "b1", "b2"]) == 3
    finally:
        client.close()
