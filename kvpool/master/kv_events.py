"""The pool's own KV events: what the master stores and drops, per tier, in vLLM's format.

``BlockStored``/``BlockRemoved`` for the memory (``CPU``) and SSD (``DISK``) tiers on a
ZMQ PUB socket exactly as a vLLM instance publishes them, with a ROUTER socket for
replays, so an llm-d- or Dynamo-style indexer consumes the pool as one more tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from kvpool.protocol.kv_events import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_DISK,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    encode_batch,
)

__all__ = ["PoolEventPublisher"]

log = logging.getLogger("kvpool.master")
_FLUSH_S = 0.05  # events wait at most this long for their batch


def _hash(key: str) -> bytes:
    """An object key as a block hash: its 16 bytes when it is kvpool's hex, else its text."""
    try:
        return bytes.fromhex(key) if len(key) == 32 else key.encode()
    except ValueError:
        return key.encode()


# Rules:
# - Recording an event is an append under a lock (the master's request path); encoding and
#   sending happen on the publisher's own thread, one batch per flush interval.
# - Batches are numbered from 0 and the last ``buffer_steps`` are kept for replay: a
#   subscriber that missed some (or joined late) asks for them by number.
# - Puts carry no token ids, so stored blocks have none (block_size 0): an indexer matches
#   them with the vLLM instances' own events, which name the same keys with their tokens.
class PoolEventPublisher:
    """Publishes the pool's KV events on ZMQ (see the module docstring)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str = "", *, buffer_steps: int = 10_000
    ) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else ""
        )
        self._pending: list[Event] = []
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._closed = threading.Event()
        self.published = 0  # events sent
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    def stored(self, key: str, ssd: bool = False) -> None:
        event = BlockStored(
            block_hashes=[_hash(key)],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=MEDIUM_DISK if ssd else MEDIUM_CPU,
            lora_name=None,
        )
        with self._lock:
            self._pending.append(event)

    def removed(self, key: str, ssd: bool = False) -> None:
        event = BlockRemoved(block_hashes=[_hash(key)], medium=MEDIUM_DISK if ssd else MEDIUM_CPU)
        with self._lock:
            self._pending.append(event)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._closed.is_set():
            if self._replay is not None:
                if dict(poller.poll(int(_FLUSH_S * 1000))):
                    self._serve_replay()
            else:
                time.sleep(_FLUSH_S)
            self._flush()
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
        seq = self._seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((b"", seq, payload))
        except Exception as exc:  # a broken socket loses this batch, never the master
            log.warning("kv events: could not publish a batch: %s", exc)
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.published += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: nothing to answer
        client, _, start = frames
        since = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= since:
                self._replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
