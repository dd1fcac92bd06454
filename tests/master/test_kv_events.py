"""``kvpool master --kv_events_endpoint``: the pool's KV events, read with vLLM's decoder."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvpool.client.client import Client
from kvpool.protocol.kv_events import END_SEQ
from kvpool.testing.processes import start_master

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's import


def receive(sub: zmq.Socket[bytes], want: int, timeout_s: float = 10.0) -> list[Any]:
    """Batches from the PUB socket until ``want`` events came, decoded by vLLM."""
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < want and time.monotonic() < deadline:
        if sub.poll(200):
            _topic, _seq, payload = sub.recv_multipart()
            events += decoder.decode(payload).events
    return events


def test_the_pool_publishes_stores_and_removals_per_tier_and_replays(tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    master = start_master(
        "--host", "127.0.0.1", f"--kv_events_endpoint={endpoint}",
        f"--kv_events_replay_endpoint={replay}", log_path=tmp_path / "master.log",
    )  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        key = "ab" * 16
        with Client(master.address, timeout_s=10) as pool:
            pool.put(key, b"x" * 4096)
            stored = receive(sub, 1)
            pool.remove(key)
            removed = receive(sub, 1)
        assert type(stored[0]).__name__ == "BlockStored" and stored[0].medium == "CPU"
        assert stored[0].block_hashes == [bytes.fromhex(key)]
        assert type(removed[0]).__name__ == "BlockRemoved" and removed[0].medium == "CPU"
        assert removed[0].block_hashes == [bytes.fromhex(key)]
        # a subscriber that missed them asks the replay socket, as vLLM's own would
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            replayed.append(int.from_bytes(frames[2], "big"))
        assert replayed == [0, 1]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        master.kill()


def test_a_bad_endpoint_is_a_one_line_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "master", "--port", "0",
         "--kv_events_endpoint=tcp://nowhere:notaport"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kv_events_endpoint tcp://nowhere:notaport" in lines[0]
