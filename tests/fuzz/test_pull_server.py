"""The prefill's pull server (the transfer connector's ``kv_port``) fed random and mutated
P→D frames.  No vLLM: a real :class:`TransferWorker` in the producer role over NumPy caches.

After every example, on a fresh connection: a decode pulls a request P holds and gets
exactly P's pages.  The hostile connection must end in well-formed replies and a close once
the peer half-closes, and no connection handler may fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.connectors.transfer.jobs import HoldJob, TransferJobs
from kvpool.connectors.transfer.tcp import TcpPullTransport
from kvpool.connectors.transfer.worker import TransferWorker
from kvpool.datapath.framing import deadline_after
from kvpool.protocol.pull import PULL_REPLY_CODEC, PULL_REQUEST_CODEC, Pull, PullDone
from kvpool.security.peer import PeerSettings
from tests.connectors.transfer.helpers import BLOCK, LAYERS, ROW, caches, config, free_port, start
from tests.fuzz.frames import FUZZ_SOCKET, mutated_frames
from tests.fuzz.peer import Failures, decode_replies, send_and_close, send_and_read
from tests.fuzz.wires import WIRES

pytestmark = pytest.mark.timeout(240)

PULL_WIRE = next(w for w in WIRES if w.name == "pull-request")
HEADS = 2
# P's transfer timeout: how long a pull of a request not held (yet) waits before its
# refusal, and how long P may take to send a pull's pages.  Short, since fuzzed pulls
# mostly name no held request, yet far above what the probe's send takes on a loaded
# machine.
WAIT_MS = 1000
NAMES = st.sampled_from(["group-a", "p-held", "", *LAYERS]) | st.text(max_size=12)
# page bytes of the test's caches, so a fuzzed pull can get the size right too
PAGE_BYTES = HEADS * BLOCK * ROW
HELD_PULLS = (
    Pull("p-held", [5, 6], 0, HEADS, list(LAYERS), 0, 1, PAGE_BYTES, "group-a"),
    PullDone("p-held", 0, 1, "group-a"),
)
_requests = itertools.count()


@pytest.fixture(scope="module")
def failures() -> Iterator[Failures]:
    with Failures.of("kvpool.datapath") as handler:
        yield handler


@pytest.fixture(scope="module")
def prefill(failures: Failures) -> Iterator[tuple[TransferWorker, dict[str, np.ndarray], int]]:
    workers: list[TransferWorker] = []
    port = free_port()
    worker, arrays = start(
        workers, config("kv_producer", port, transfer=WAIT_MS), 0, 1, HEADS, seed=7
    )
    yield worker, arrays, port
    for w in workers:
        w.close()


def assert_prefill_serves(
    prefill: tuple[TransferWorker, dict[str, np.ndarray], int], failures: Failures
) -> None:
    worker, p_kv, port = prefill
    assert not failures.records, failures.records[0].getMessage()
    request = f"p-probe-{next(_requests)}"
    worker.submit(TransferJobs(holds=[HoldJob(request, (3, 1))]))
    d_caches, d_kv = caches(HEADS, seed=None)
    transport = TcpPullTransport(PeerSettings(10))
    transport.register(d_caches)
    page_bytes = PAGE_BYTES
    pull = Pull(request, [3, 1], 0, HEADS, list(LAYERS), 0, 1, page_bytes, "group-a")
    with transport.connect("127.0.0.1", port, 10) as link:
        assert link.pull(pull, [0, 1], 0, deadline_after(10)) == 2 * 2 * page_bytes
    for name in LAYERS:
        np.testing.assert_array_equal(d_kv[name][[0, 1]], p_kv[name][[3, 1]])


@FUZZ_SOCKET
@given(frame=mutated_frames(PULL_WIRE, strings=NAMES, samples=HELD_PULLS))
def test_any_frame_leaves_the_pull_server_serving_other_decodes(
    prefill: tuple[TransferWorker, dict[str, np.ndarray], int],
    failures: Failures,
    frame: bytes,
) -> None:
    # a request P holds, so a fuzzed pull naming it meets every rule of a real pull
    prefill[0].submit(TransferJobs(holds=[HoldJob("p-held", (5, 6))]))
    outcome = send_and_close(("127.0.0.1", prefill[2]), frame)
    assert outcome.closed, f"the pull server held a half-closed connection after {frame!r}"
    decode_replies(outcome.received, PULL_REPLY_CODEC)
    assert_prefill_serves(prefill, failures)


STALLS = {
    "mid-header": PULL_REQUEST_CODEC.encode(HELD_PULLS[0])[:7],
    "mid-body": PULL_REQUEST_CODEC.encode(HELD_PULLS[0])[:-3],
}


@pytest.mark.parametrize("data", list(STALLS.values()), ids=list(STALLS))
def test_a_decode_stalling_mid_frame_is_dropped_in_bounded_time(
    prefill: tuple[TransferWorker, dict[str, np.ndarray], int], failures: Failures, data: bytes
) -> None:
    _, closed = send_and_read(("127.0.0.1", prefill[2]), data, PULL_REPLY_CODEC, until_close=True)
    assert closed, "the pull server waited past the bound for the rest of a frame"
    assert_prefill_serves(prefill, failures)
