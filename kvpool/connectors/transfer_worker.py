"""The worker half of the transfer connector: P serves KV pages, D pulls them.

No vLLM import: the caches are numpy ``uint8`` views of vLLM's KV tensors, so this
module is tested with plain arrays, real sockets and real threads.

P (producer) runs one TCP server thread per worker rank on
``rank_port(kv_port, dp_rank, tp_size, tp_rank)``.  It holds each finished prefill
request's blocks (told by the scheduler through :class:`HoldJob`) until every expected D
rank pulled its heads or released them, or ``hold_timeout_ms`` passed; then the request
appears once in ``finished_sending`` and vLLM frees the blocks.

D (consumer) pulls in a small thread pool, off the engine loop: one connection per P
rank the topology routes it to, page slices received straight into its KV cache.  Any
failure (refused, connect error, timeout, short read) reports the request as finished
AND failed, with its blocks as load errors, so ``kv_load_failure_policy: recompute``
recomputes it.  Connect and transfer waits are bounded by the configured timeouts.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvpool.connectors.topology import expected_pullers, local_heads, plan_pulls, rank_port
from kvpool.connectors.transfer_config import CONNECTOR_NAME, TransferConfig
from kvpool.connectors.transfer_jobs import RecvJob, ReleaseJob, TransferJobs
from kvpool.connectors.transfer_protocol import (
    REPLY_CODEC,
    REQUEST_CODEC,
    Done,
    Layer,
    Pull,
    Refused,
    Release,
)
from kvpool.connectors.transfer_state import RecvResults, SendTracker
from kvpool.errors import ConfigError, KVPoolError, PeerTimeout, ProtocolError, TransferError
from kvpool.transfer.wire import (
    BadRequest,
    deadline_after,
    recv_exactly_into,
    recv_frame,
    recv_request,
    send_frame,
    tune_socket,
)

__all__ = ["PagedCaches", "RankInfo", "TransferResults", "TransferWorker"]

# Under "vllm." so that vLLM's log handler prints these lines in the server log.
logger = logging.getLogger("vllm.kvpool.transfer")
_PREFIX = f"[{CONNECTOR_NAME}]"
_ACCEPT_POLL_S = 0.5  # how often the accept loop looks at the stop flag
_IDLE_S = 60.0  # a D connection idle this long between requests is closed
_PULL_THREADS = 4


class PagedCaches:
    """vLLM's per-layer KV caches as ``uint8`` arrays ``[num_blocks, heads, block_size, row]``.

    A *page slice* (``[block, h0:h1]``) is contiguous in this layout, which is what lets
    both sides send and receive in place.
    """

    def __init__(self, layers: Mapping[str, np.ndarray]) -> None:
        if not layers:
            raise ConfigError(f"{CONNECTOR_NAME}: no KV cache layers were registered")
        shapes = {arr.shape for arr in layers.values()}
        if len(shapes) != 1:
            raise ConfigError(
                f"{CONNECTOR_NAME}: KV cache layers differ in shape: {sorted(shapes)}"
            )
        for name, arr in layers.items():
            if arr.ndim != 4 or arr.dtype != np.uint8 or not arr.flags.c_contiguous:
                raise ConfigError(
                    f"{CONNECTOR_NAME}: layer {name} is not a contiguous "
                    "[num_blocks, heads, block_size, row] byte view"
                )
        self._layers = dict(layers)
        self.names: list[str] = list(layers)
        self.num_blocks, self.num_heads, self.block_size, row = next(iter(shapes))
        self.head_bytes = self.block_size * row

    def page(self, layer: str, block: int, head_start: int, head_count: int) -> memoryview:
        page = self._layers[layer][block, head_start : head_start + head_count]
        return page.data.cast("B")


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this worker sits: its TP rank and size, its DP rank, the model's KV heads."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    total_kv_heads: int


@dataclass(frozen=True, slots=True)
class TransferResults:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


class TransferWorker:
    """One worker rank's transfer engine (P server and/or D puller)."""

    def __init__(
        self,
        config: TransferConfig,
        rank: RankInfo,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.rank = rank
        self._clock = clock
        self._caches: PagedCaches | None = None
        self._cond = threading.Condition()
        self._tracker = SendTracker()
        self._recv = RecvResults()
        self._recv_lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._counts: Counter[str] = Counter()  # see transfer_stats.COUNTERS
        self._counts_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._pool = ThreadPoolExecutor(_PULL_THREADS, thread_name_prefix="kvpool-pull")
        self.port = rank_port(config.kv_port, rank.dp_rank, rank.tp_size, rank.tp_rank)
        peer_tp = config.peer.tp_size if config.peer is not None else rank.tp_size
        self._peer_tp = peer_tp
        self._expected = (
            expected_pullers(rank.total_kv_heads, rank.tp_size, peer_tp, rank.tp_rank)
            if config.is_producer
            else frozenset()
        )

    # -- life cycle ------------------------------------------------------------------

    def register(self, caches: PagedCaches) -> None:
        """Take the KV caches; on P, start serving them.  Logs the seed's §8.2 line."""
        mine = local_heads(self.rank.total_kv_heads, self.rank.tp_size, self.rank.tp_rank)
        if caches.num_heads != len(mine):
            raise ConfigError(
                f"{CONNECTOR_NAME}: KV cache holds {caches.num_heads} heads per block but TP rank "
                f"{self.rank.tp_rank}/{self.rank.tp_size} of {self.rank.total_kv_heads} KV heads "
                f"should hold {len(mine)}"
            )
        self._caches = caches
        if self.config.is_producer:
            self._listen()
        peer = self.config.peer
        logger.info(
            "%s role=%s, port=%d, host=%s, tp_rank=%d/%d, dp_rank=%d, peer=%s, engine_id=%s",
            _PREFIX,
            self.config.role,
            self.port,
            self.config.kv_host,
            self.rank.tp_rank,
            self.rank.tp_size,
            self.rank.dp_rank,
            "unset" if peer is None else f"dp_size={peer.dp_size},tp_size={peer.tp_size}",
            self.config.engine_id,
        )

    def close(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for thread in self._threads:
            thread.join(timeout=2 * _ACCEPT_POLL_S)

    # -- per step ----------------------------------------------------------------------

    def submit(self, jobs: TransferJobs) -> None:
        """Act on one step's jobs from the scheduler (never blocks on the network)."""
        if jobs.holds:
            self._count(holds=len(jobs.holds))
            now = self._now_ms()
            with self._cond:
                for hold in jobs.holds:
                    self._tracker.hold(
                        hold.request_id,
                        hold.block_ids,
                        self._expected,
                        now,
                        self.config.hold_timeout_ms,
                    )
                self._cond.notify_all()
        for job in jobs.recvs:
            self._pool.submit(self._run_recv, job)
        for release in jobs.releases:
            self._pool.submit(self._run_release, release)

    def results(self) -> TransferResults:
        """Sends whose blocks may be freed, loads finished (ok or not), loads failed."""
        with self._cond:
            expired = self._tracker.expire(self._now_ms())
            for rid in expired:
                logger.warning(
                    "%s no decode pulled request %s within hold_timeout_ms=%d; freeing its blocks",
                    _PREFIX,
                    rid,
                    self.config.hold_timeout_ms,
                )
            sending = self._tracker.take_finished()
        self._count(holds_expired=len(expired), holds_released=len(sending) - len(expired))
        with self._recv_lock:
            snap = self._recv.take()
        self._load_errors |= snap.failed_block_ids
        return TransferResults(sending, snap.finished, snap.failed)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_counts(self) -> dict[str, int]:
        """Counter deltas since the last call (``transfer_stats.COUNTERS``)."""
        with self._counts_lock:
            counts, self._counts = dict(self._counts), Counter()
        return counts

    def _count(self, **deltas: int) -> None:
        with self._counts_lock:
            self._counts.update({name: n for name, n in deltas.items() if n})

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._tracker)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # -- P: the server -----------------------------------------------------------------

    def _listen(self) -> None:
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
            return (
                f"decode rank {pull.dst_rank} does not read from prefill rank {self.rank.tp_rank}"
            )
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

    # -- D: the puller -----------------------------------------------------------------

    def _run_recv(self, job: RecvJob) -> None:
        started = time.monotonic()
        try:
            nbytes = self._pull(job)
        except Exception as exc:  # every load must be reported, whatever went wrong
            logger.warning(
                "%s loading request %s from %s:%d failed (%s); it will be recomputed "
                "if kv_load_failure_policy is recompute",
                _PREFIX,
                job.request_id,
                job.remote_host,
                job.remote_port,
                exc,
            )
            self._count(pull_failures=1)
            with self._recv_lock:
                self._recv.failed(job.request_id, list(job.local_block_ids))
            if not isinstance(exc, _Unreachable):
                # P answered but the pull broke: tell it to stop holding the blocks now
                # rather than after hold_timeout_ms (the request is recomputed here).
                self._run_release(
                    ReleaseJob(
                        job.request_id,
                        job.remote_request_id,
                        job.remote_host,
                        job.remote_port,
                        job.remote_tp_size,
                    )
                )
            return
        self._count(pulls=1, pulled_blocks=len(job.local_block_ids), pulled_bytes=nbytes)
        with self._recv_lock:
            self._recv.succeeded(job.request_id, nbytes)
        logger.info(
            "%s loaded request %s from %s:%d: %d blocks, %d bytes in %.1f ms",
            _PREFIX,
            job.request_id,
            job.remote_host,
            job.remote_port,
            len(job.local_block_ids),
            nbytes,
            (time.monotonic() - started) * 1000,
        )

    def _pull(self, job: RecvJob) -> int:
        caches = self._caches
        if caches is None:
            raise TransferError("KV caches are not registered yet")
        if len(job.local_block_ids) != len(job.remote_block_ids):
            raise TransferError(
                f"{len(job.local_block_ids)} local blocks but {len(job.remote_block_ids)} remote"
            )
        deadline = deadline_after(self.config.transfer_timeout_ms / 1000)
        total = 0
        for piece in plan_pulls(
            self.rank.total_kv_heads, job.remote_tp_size, self.rank.tp_size, self.rank.tp_rank
        ):
            pull = Pull(
                request_id=job.remote_request_id,
                block_ids=list(job.remote_block_ids),
                head_start=piece.src_start,
                head_count=piece.count,
                layers=caches.names,
                dst_rank=self.rank.tp_rank,
                dst_tp_size=self.rank.tp_size,
                page_bytes=piece.count * caches.head_bytes,
                group=self.config.group,
            )
            with self._connect(job.remote_host, job.remote_port + piece.src_rank, deadline) as sock:
                send_frame(sock, REQUEST_CODEC, pull, None, deadline)
                for index, name in enumerate(caches.names):
                    reply, payload = recv_frame(sock, REPLY_CODEC, deadline)
                    _expect_layer(reply, payload, index, pull.page_bytes, len(job.local_block_ids))
                    for block in job.local_block_ids:
                        view = caches.page(name, block, piece.dst_start, piece.count)
                        recv_exactly_into(sock, view, deadline, "KV pages")
                    total += payload
                reply, _ = recv_frame(sock, REPLY_CODEC, deadline)
                if not isinstance(reply, Done):
                    raise ProtocolError(f"expected the end of the transfer, got {reply!r}")
        return total

    def _run_release(self, job: ReleaseJob) -> None:
        deadline = deadline_after(self.config.transfer_timeout_ms / 1000)
        ranks = {
            p.src_rank
            for p in plan_pulls(
                self.rank.total_kv_heads, job.remote_tp_size, self.rank.tp_size, self.rank.tp_rank
            )
        }
        release = Release(
            job.remote_request_id, self.rank.tp_rank, self.rank.tp_size, self.config.group
        )
        for src_rank in sorted(ranks):
            try:
                with self._connect(job.remote_host, job.remote_port + src_rank, deadline) as sock:
                    send_frame(sock, REQUEST_CODEC, release, None, deadline)
                    recv_frame(sock, REPLY_CODEC, deadline)
            except KVPoolError as exc:  # P's hold timeout frees the blocks anyway
                logger.info("%s could not release %s on P: %s", _PREFIX, job.remote_request_id, exc)

    def _connect(self, host: str, port: int, deadline: float) -> socket.socket:
        timeout = min(self.config.connect_timeout_ms / 1000, deadline - time.monotonic())
        if timeout <= 0:
            raise _Unreachable(f"no time left to connect to {host}:{port}")
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            raise _Unreachable(f"connecting to prefill {host}:{port} timed out") from None
        except OSError as exc:
            raise _Unreachable(f"cannot connect to prefill {host}:{port}: {exc}") from None
        tune_socket(sock)
        return sock


class _Unreachable(TransferError):
    """The prefill could not be reached at all (no point sending it a release)."""


def _expect_layer(reply: object, payload: int, index: int, page_bytes: int, blocks: int) -> None:
    if isinstance(reply, Refused):
        raise TransferError(f"prefill refused: {reply.reason}")
    if not isinstance(reply, Layer) or reply.index != index:
        raise ProtocolError(f"expected layer {index}, got {reply!r}")
    if reply.page_bytes != page_bytes or payload != page_bytes * blocks:
        raise ProtocolError(
            f"layer {index}: {payload} bytes of {reply.page_bytes}-byte pages, "
            f"expected {blocks} pages of {page_bytes}"
        )


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
