"""P→D pulls over Mooncake's Transfer Engine: the transfer connector's other transport.

kvpool's pull conversation (:mod:`kvpool.protocol.engine_pull`) runs on the ``kv_port``
connection; only page bytes go through the engine: both sides register their KV caches
once, P answers a pull with where its page slices lie, D batch-reads them and tells P.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Sequence

import numpy as np

from kvpool.closing import Closing
from kvpool.config.kv_transfer import TRANSFER_CONNECTOR
from kvpool.connectors.pages import CacheSet, PagedCaches
from kvpool.connectors.transfer.pull_port import PortTransport
from kvpool.datapath.framing import recv_frame, send_frame
from kvpool.errors import KVPoolError, ProtocolError, TransferError
from kvpool.mooncake.mover import EngineMover
from kvpool.protocol.engine_pull import (
    ENGINE_REPLY_CODEC,
    ENGINE_REQUEST_CODEC,
    Pages,
    Read,
    Unread,
)
from kvpool.protocol.pull import Done, Pull, PullDone, Refused
from kvpool.security.peer import PeerSettings

__all__ = ["EngineLink", "EngineTransport"]

logger = logging.getLogger("vllm.kvpool.transfer")
_PREFIX = f"[{TRANSFER_CONNECTOR}]"


def _address(view: memoryview) -> int:
    """Where a (non-empty) byte view of the KV caches starts in this process's memory."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class EngineTransport(PortTransport):
    """Pulls whose pages move with Mooncake's Transfer Engine over ``protocol``."""

    def __init__(
        self,
        *,
        hostname: str,
        protocol: str,
        device_name: str,
        peer: PeerSettings,
    ) -> None:
        # with a credential every control connection opens with the handshake
        # (.pull_port); the engine's own data ports take none
        self.name = f"{protocol} (Mooncake Transfer Engine)"
        self._hostname = hostname
        self._protocol = protocol
        self._device = device_name
        self._timeout_s = peer.timeout_s
        self._mover: EngineMover | None = None
        self._bases: dict[str, int] = {}  # layer -> address of its block 0, head 0
        super().__init__(peer, ENGINE_REQUEST_CODEC, ENGINE_REPLY_CODEC, self._lend_pages)

    def register(self, caches: PagedCaches | CacheSet) -> None:
        """Start the engine and register each layer's cache tensor with it, once."""
        mover = EngineMover.start(self._hostname, self._protocol, self._device, self._timeout_s)
        bases: dict[str, int] = {}
        regions: dict[int, int] = {}  # address -> length
        for group in caches.groups:  # a hybrid model: each KV cache group's geometry
            for name in group.names:
                bases[name] = addr = _address(group.page(name, 0, 0, group.num_heads))
                length = group.num_blocks * group.block_stride
                regions[addr] = max(regions.get(addr, 0), length)
        # Layers that share one tensor (vLLM's KV sharing, a hybrid model's groups) are
        # registered once.
        mover.register(sorted(regions.items()))
        self._caches, self._mover, self._bases = caches, mover, bases
        logger.info(
            "%s Transfer Engine %s over %s: %d KV cache regions registered",
            _PREFIX,
            mover.endpoint,
            self._protocol,
            len(set(bases.values())),
        )

    def close(self) -> None:
        super().close()
        if self._mover is not None:
            self._mover.close()

    # -- D ---------------------------------------------------------------------------

    def connect(self, host: str, port: int, timeout_s: float) -> EngineLink:
        if self._caches is None or self._mover is None:
            raise TransferError("KV caches are not registered yet")
        sock = self._port.dial(host, port, timeout_s)
        return EngineLink(sock, self._caches, self._mover, self._bases)

    # -- P ---------------------------------------------------------------------------

    def _lend_pages(self, conn: socket.socket, pull: Pull, deadline: float) -> int | None:
        """P's side of an admitted pull: say where the page slices lie, then wait for D
        to have read them with its engine (``None``: it could not)."""
        assert self._caches is not None and self._mover is not None
        caches, mover = self._caches.of(pull.layers), self._mover  # the pull's group
        pages = Pages(
            endpoint=mover.endpoint,
            layer_addrs=[self._bases[name] for name in pull.layers],
            block_stride=caches.block_stride,
            head_bytes=caches.head_bytes,
        )
        send_frame(conn, ENGINE_REPLY_CODEC, pages, None, deadline)
        # The blocks stay held until D says it has them (or gives up): only then may the
        # worker let vLLM free them.
        answer, _ = recv_frame(conn, ENGINE_REQUEST_CODEC, deadline)
        if isinstance(answer, Unread):
            logger.warning(
                "%s decode rank %d could not read request %s: %s",
                _PREFIX,
                pull.dst_rank,
                pull.request_id,
                answer.reason,
            )
            return None
        if not isinstance(answer, Read):
            raise ProtocolError(f"expected the decode's Read, got {answer!r}")
        return pull.head_count * caches.head_bytes * len(pull.block_ids) * len(pull.layers)


class EngineLink(Closing):
    """One D → P control connection; the pages come through D's Transfer Engine."""

    def __init__(
        self,
        sock: socket.socket,
        caches: PagedCaches | CacheSet,
        mover: EngineMover,
        bases: dict[str, int],
    ) -> None:
        self._sock = sock
        self._caches = caches
        self._mover = mover
        self._bases = bases

    def close(self) -> None:
        self._sock.close()

    def pull(self, pull: Pull, block_ids: Sequence[int], dst_start: int, deadline: float) -> int:
        sock = self._sock
        send_frame(sock, ENGINE_REQUEST_CODEC, pull, None, deadline)
        reply, _ = recv_frame(sock, ENGINE_REPLY_CODEC, deadline)
        if isinstance(reply, Refused):
            raise TransferError(f"prefill refused: {reply.reason}")
        if not isinstance(reply, Pages):
            raise ProtocolError(f"expected where the pages lie, got {reply!r}")
        local, remote, lengths = self._plan(pull, reply, block_ids, dst_start)
        try:
            self._mover.read(reply.endpoint, local, remote, lengths, deadline)
        except TransferError as exc:
            # best effort: P then logs why instead of waiting out its deadline
            with contextlib.suppress(KVPoolError):
                send_frame(sock, ENGINE_REQUEST_CODEC, Unread(str(exc)), None, deadline)
            raise
        total = sum(lengths)
        send_frame(sock, ENGINE_REQUEST_CODEC, Read(total), None, deadline)
        done, _ = recv_frame(sock, ENGINE_REPLY_CODEC, deadline)
        if not isinstance(done, Done):
            raise ProtocolError(f"expected the end of the transfer, got {done!r}")
        return total

    def _plan(
        self, pull: Pull, pages: Pages, block_ids: Sequence[int], dst_start: int
    ) -> tuple[list[int], list[int], list[int]]:
        """(local, remote, length) of the engine requests: one per page slice, or per run
        of slices that lie back to back in both caches (whole blocks, consecutive ids)."""
        caches = self._caches.of(pull.layers)
        if len(pages.layer_addrs) != len(pull.layers) or pages.head_bytes != caches.head_bytes:
            raise ProtocolError(
                f"prefill's pages ({len(pages.layer_addrs)} layers of {pages.head_bytes}-byte"
                f" heads) do not match the pull ({len(pull.layers)} layers of"
                f" {caches.head_bytes}-byte heads)"
            )
        # The engine writes wherever it is told in our own memory: check what the
        # worker asked for stays inside our caches (P checks its side, and its engine
        # refuses ranges outside its registered memory).
        if dst_start < 0 or dst_start + pull.head_count > caches.num_heads:
            raise TransferError(
                f"heads {dst_start}+{pull.head_count} exceed this rank's {caches.num_heads}"
            )
        if any(not 0 <= b < caches.num_blocks for b in block_ids):
            raise TransferError(f"block ids {list(block_ids)} exceed this rank's cache")
        size = pull.head_count * caches.head_bytes
        src_head = pull.head_start * pages.head_bytes
        dst_head = dst_start * caches.head_bytes
        stride = caches.block_stride
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for name, src_base in zip(pull.layers, pages.layer_addrs, strict=True):
            dst_base = self._bases[name]
            # never across layers: two layers' regions may touch, and a request must lie
            # inside one registered region
            first = len(lengths)
            for src_block, dst_block in zip(pull.block_ids, block_ids, strict=True):
                src = src_base + src_block * pages.block_stride + src_head
                dst = dst_base + dst_block * stride + dst_head
                if (
                    len(lengths) > first
                    and remote[-1] + lengths[-1] == src
                    and local[-1] + lengths[-1] == dst
                ):
                    lengths[-1] += size  # adjacent on both sides: one request moves both
                else:
                    local.append(dst)
                    remote.append(src)
                    lengths.append(size)
        return local, remote, lengths

    def done(self, message: PullDone, deadline: float) -> None:
        send_frame(self._sock, ENGINE_REQUEST_CODEC, message, None, deadline)
        recv_frame(self._sock, ENGINE_REPLY_CODEC, deadline)
