"""P's side of the transfer: a TCP server that hands held blocks to the D ranks that pull.

One server per prefill worker rank, on ``rank_port(kv_port, dp_rank, tp_size, tp_rank)``.
A thread accepts; each decode connection gets a thread that serves its requests
(:mod:`kvpool.connectors.transfer_protocol`): a pull is answered from the request's held
blocks (waiting, bounded, for the scheduler's hold to arrive), straight from the KV cache
pages; a release just marks that D rank done.  Every refusal says why, and the decode
then recomputes.  The hold book-keeping (:class:`SendTracker`) is shared with the worker,
which owns it, under the worker's condition variable.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from kvpool.connectors.transfer_config import CONNECTOR_NAME, TransferConfig
from kvpool.connectors.transfer_pages import PagedCaches
from kvpool.connectors.transfer_protocol import (
    REPLY_CODEC,
    REQUEST_CODEC,
    Done,
    Layer,
    Pull,
    Refused,
    Release,
)
from kvpool.connectors.transfer_state import SendTracker
from kvpool.errors import ConfigError, KVPoolError, PeerTimeout, TransferError
from kvpool.transfer.wire import BadRequest, deadline_after, recv_request, send_frame, tune_socket

__all__ = ["KVServer"]

logger = logging.getLogger("vllm.kvpool.transfer")
_PREFIX = f"[{CONNECTOR_NAME}]"
_ACCEPT_POLL_S = 0.5  # how often the accept loop looks at the stop flag
_IDLE_S = 60.0  # a decode connection idle this long between requests is closed


class KVServer:
    """Serves one prefill rank's held blocks to the decode ranks that pull them."""

    def __init__(
        self,
        config: TransferConfig,
        *,
        port: int,
        tp_rank: int,
        peer_tp: int,
        expected: frozenset[int],
        tracker: SendTracker,
        cond: threading.Condition,
        count: Callable[..., None],
    ) -> None:
        self.config = config
        self.port = port
        self._tp_rank = tp_rank
        self._peer_tp = peer_tp
        self._expected = expected
        self._tracker = tracker
        self._cond = cond
        self._count = count
        self._caches: PagedCaches | None = None
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def close(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=2 * _ACCEPT_POLL_S)

    def start(self, caches: PagedCaches) -> None:
        """Bind the rank's port and serve ``caches`` from a background thread."""
        self._caches = caches
        try:
            listener = socket.create_server((self.config.kv_host, self.port), reuse_port=False)
        except OSError as exc:
            raise ConfigError(
                f"{CONNECTOR_NAME}: cannot listen on {self.config.kv_host}:{self.port} "
                f"(kv_port {self.config.kv_port} + rank offset): {exc}"
            ) from None
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        self._spawn(self._accept_loop, "kvpool-kv-accept")

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self._spawn(self._serve, "kvpool-kv-send", conn)

    def _serve(self, conn: socket.socket) -> None:
        timeout_s = self.config.transfer_timeout_ms / 1000
        with conn:
            tune_socket(conn)
            while not self._stopping.is_set():
                try:
                    got = recv_request(conn, REQUEST_CODEC, timeout_s, idle_timeout=_IDLE_S)
                    if got is None:
                        return
                    if isinstance(got, BadRequest):  # another version? say so, keep serving
                        reply = Refused(f"bad request: {got.error}")
                        send_frame(conn, REPLY_CODEC, reply, None, deadline_after(timeout_s))
                        continue
                    message, _ = got
                    if isinstance(message, Pull):
                        self._serve_pull(conn, message, deadline_after(timeout_s))
                    else:
                        self._serve_release(conn, message, deadline_after(timeout_s))
                except KVPoolError as exc:
                    logger.warning("%s dropping a decode connection: %s", _PREFIX, exc)
                    return

    def _refusal(self, pull: Pull | Release) -> str | None:
        """Why this rank will not serve ``pull`` (``None``: it will)."""
        group = self.config.group
        if group is not None and pull.group is not None and pull.group != group:
            return (
                f"engine_id group {pull.group!r} of the decode does not pair with this "
                f"prefill's {group!r}"
            )
        if pull.dst_tp_size != self._peer_tp:
            return (
                f"decode has tp_size {pull.dst_tp_size} but this prefill's "
                f'kv_connector_extra_config["decode"] says {self._peer_tp}'
            )
        if pull.dst_rank not in self._expected:
            return f"decode rank {pull.dst_rank} does not read from prefill rank {self._tp_rank}"
        return None

    def _wait_held(self, request_id: str, deadline: float) -> tuple[int, ...] | None:
        # The pull may race the scheduler's hold job (P answered the proxy one step before
        # its worker heard of the request), so wait for it, bounded.
        with self._cond:
            while True:
                held = self._tracker.get(request_id)
                if held is not None:
                    return held.block_ids
                if self._tracker.was_released(request_id):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def _serve_pull(self, conn: socket.socket, pull: Pull, deadline: float) -> None:
        caches = self._caches
        assert caches is not None
        reason = self._refusal(pull)
        held = None if reason else self._wait_held(pull.request_id, deadline)
        if reason is None and held is None:
            reason = f"request {pull.request_id} is not held here (expired, aborted or unknown)"
        if reason is None:
            reason = self._check_pull(pull, held or (), caches)
        if reason is not None:
            logger.warning("%s refusing pull of %s: %s", _PREFIX, pull.request_id, reason)
            send_frame(conn, REPLY_CODEC, Refused(reason), None, deadline)
            return
        page_bytes = pull.head_count * caches.head_bytes
        layer_bytes = page_bytes * len(pull.block_ids)
        for index, name in enumerate(pull.layers):
            _send_all(conn, REPLY_CODEC.encode(Layer(index, page_bytes), layer_bytes), deadline)
            for block in pull.block_ids:
                _send_all(
                    conn, caches.page(name, block, pull.head_start, pull.head_count), deadline
                )
        total = layer_bytes * len(pull.layers)
        send_frame(conn, REPLY_CODEC, Done(total), None, deadline)
        # Count before releasing: the engine step that frees the blocks may be P's last
        # one for a while, and it should carry these counts.
        self._count(served_pulls=1, served_bytes=total)
        with self._cond:
            freed = self._tracker.mark_done(pull.request_id, pull.dst_rank, total)
        logger.info(
            "%s sent request %s to decode rank %d: %d blocks, %d bytes%s",
            _PREFIX,
            pull.request_id,
            pull.dst_rank,
            len(pull.block_ids),
            total,
            "; blocks released" if freed else "",
        )

    def _check_pull(self, pull: Pull, held: tuple[int, ...], caches: PagedCaches) -> str | None:
        if not set(pull.block_ids) <= set(held):
            return f"blocks {sorted(set(pull.block_ids) - set(held))} are not this request's"
        if pull.head_start < 0 or pull.head_count <= 0:
            return f"bad head range {pull.head_start}+{pull.head_count}"
        if pull.head_start + pull.head_count > caches.num_heads:
            return (
                f"heads {pull.head_start}+{pull.head_count} exceed this rank's {caches.num_heads}"
            )
        unknown = [name for name in pull.layers if name not in caches.names]
        if unknown or not pull.layers:
            return f"unknown layers {unknown[:3]} (different models on P and D?)"
        if pull.page_bytes != pull.head_count * caches.head_bytes:
            return (
                f"page size differs: decode expects {pull.page_bytes} bytes per page slice, "
                f"prefill has {pull.head_count * caches.head_bytes} (block size or dtype differ)"
            )
        return None

    def _serve_release(self, conn: socket.socket, release: Release, deadline: float) -> None:
        reason = self._refusal(release)
        if reason is None:
            with self._cond:
                self._tracker.mark_done(release.request_id, release.dst_rank)
        send_frame(conn, REPLY_CODEC, Refused(reason) if reason else Done(0), None, deadline)


def _send_all(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeout("timed out sending KV pages")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise PeerTimeout("timed out sending KV pages: the decode stopped reading") from None
    except OSError as exc:
        raise TransferError(f"connection to the decode failed: {exc}") from None
