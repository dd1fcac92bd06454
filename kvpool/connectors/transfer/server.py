"""P's side of the transfer: the rules by which a prefill rank serves its held blocks, one
server per rank on its ``kv_port``; the transport carries requests and pages, this decides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpool.config.kv_transfer import TRANSFER_CONNECTOR, TransferConfig
from kvpool.connectors.pages import CacheSet, PagedCaches
from kvpool.connectors.transfer.state import SendTracker
from kvpool.connectors.transfer.transport import KVTransport
from kvpool.errors import ConfigError
from kvpool.protocol.pull import Pull, PullDone

__all__ = ["PullServer"]

logger = logging.getLogger("vllm.kvpool.transfer")
_PREFIX = f"[{TRANSFER_CONNECTOR}]"


# A pull is served from the request's held blocks (waiting, bounded, for the scheduler's
# hold to arrive), a PullDone just marks that D rank done.  Every refusal says why, and the
# decode then recomputes.  The hold book-keeping (SendTracker) is shared with the worker,
# which owns it, under the worker's condition variable.
class PullServer:
    """Serves one prefill rank's held blocks to the decode ranks that pull them."""

    def __init__(
        self,
        config: TransferConfig,
        transport: KVTransport,
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
        self._transport = transport
        self._tp_rank = tp_rank
        self._peer_tp = peer_tp
        self._expected = expected
        self._tracker = tracker
        self._cond = cond
        self._count = count
        self._caches: PagedCaches | CacheSet | None = None
        self._waiting = 0  # pulls that arrived before their hold (under cond)

    def start(self, caches: PagedCaches | CacheSet) -> None:
        """Serve ``caches`` (already registered with the transport) on the rank's port."""
        self._caches = caches
        try:
            self._transport.serve(self.config.kv_host, self.port, self)
        except OSError as exc:
            raise ConfigError(
                f"{TRANSFER_CONNECTOR}: cannot listen on {self.config.kv_host}:{self.port} "
                f"(kv_port {self.config.kv_port} + rank offset): {exc}"
            ) from None

    @property
    def num_waiting(self) -> int:
        """Pulls waiting for the scheduler's hold of their request."""
        with self._cond:
            return self._waiting

    # -- the transport's questions (PullHandler) -------------------------------------

    def admit(self, pull: Pull, deadline: float) -> str | None:
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
        return reason

    def served(self, pull: Pull, nbytes: int) -> None:
        # Count before releasing: the engine step that frees the blocks may be P's last
        # one for a while, and it should carry these counts.
        self._count(served_pulls=1, served_bytes=nbytes)
        with self._cond:
            if not pull.final:  # more of this D rank's pulls (KV cache groups) follow
                self._tracker.add_sent(pull.request_id, nbytes)
                return
            freed = self._tracker.mark_done(pull.request_id, pull.dst_rank, nbytes)
            self._cond.notify_all()  # a step waiting for news reports the release now
        logger.info(
            "%s sent request %s to decode rank %d/%d from prefill rank %d (port %d): "
            "%d blocks, %d bytes%s",
            _PREFIX,
            pull.request_id,
            pull.dst_rank,
            pull.dst_tp_size,
            self._tp_rank,
            self.port,
            len(pull.block_ids),
            nbytes,
            "; blocks released" if freed else "",
        )

    def done(self, message: PullDone) -> str | None:
        reason = self._refusal(message)
        if reason is None:
            with self._cond:
                self._tracker.mark_done(message.request_id, message.dst_rank)
                self._cond.notify_all()
        return reason

    # -- the rules -----------------------------------------------------------------------

    def _refusal(self, pull: Pull | PullDone) -> str | None:
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
            self._waiting += 1
            try:
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
            finally:
                self._waiting -= 1

    def _check_pull(
        self, pull: Pull, held: tuple[int, ...], cache_set: PagedCaches | CacheSet
    ) -> str | None:
        if not set(pull.block_ids) <= set(held):
            return f"blocks {sorted(set(pull.block_ids) - set(held))} are not this request's"
        if pull.head_start < 0 or pull.head_count <= 0:
            return f"bad head range {pull.head_start}+{pull.head_count}"
        try:
            caches = cache_set.of(pull.layers)  # one KV cache group's layers
        except ConfigError as exc:
            return str(exc)
        if pull.head_start + pull.head_count > caches.num_heads:
            return (
                f"heads {pull.head_start}+{pull.head_count} exceed this rank's {caches.num_heads}"
            )
        if pull.page_bytes != pull.head_count * caches.head_bytes:
            return (
                f"page size differs: decode expects {pull.page_bytes} bytes per page slice, "
                f"prefill has {pull.head_count * caches.head_bytes} (block size or dtype differ)"
            )
        return None
