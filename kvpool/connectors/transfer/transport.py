"""The P→D data-plane seam: how KV pages move from a prefill rank to a decode rank.

The transfer worker decides *what* moves; a :class:`KVTransport` moves it: kvpool's TCP by
default, or Mooncake's Transfer Engine, chosen by the node config (:func:`make_transport`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.config.fabrics import ENGINE_PROTOCOLS, TRANSPORT_ENGINE, TRANSPORT_KVPOOL
from kvpool.config.kv_transfer import TransferConfig
from kvpool.connectors.pages import CacheSet, PagedCaches
from kvpool.errors import ConfigError, TransferError
from kvpool.protocol.pull import Pull, PullDone
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings

__all__ = [
    "TRANSPORTS",
    "KVTransport",
    "PeerLink",
    "PeerUnreachable",
    "PullHandler",
    "make_transport",
]


class PeerUnreachable(TransferError):
    """The prefill could not be reached at all (no point telling it anything)."""


class PullHandler(Protocol):
    """P's rules for the pulls a transport receives (:class:`.server.PullServer`)."""

    def admit(self, pull: Pull, deadline: float) -> str | None:
        """Why ``pull`` is refused, or ``None``: serve it (may wait, until ``deadline``)."""
        ...

    def served(self, pull: Pull, nbytes: int) -> None:
        """Every page of ``pull`` went out (``nbytes`` in all)."""
        ...

    def done(self, message: PullDone) -> str | None:
        """A D rank needs nothing of a request: why that is refused, or ``None``."""
        ...


class PeerLink(Protocol):
    """D's connection to one P rank (a context manager that closes it)."""

    def pull(self, pull: Pull, block_ids: Sequence[int], dst_start: int, deadline: float) -> int:
        """Receive ``pull``'s page slices into the registered caches' ``block_ids`` (heads
        from ``dst_start``), layer by layer; return the bytes received."""
        ...

    def done(self, message: PullDone, deadline: float) -> None:
        """Tell P this D rank is done with a request without pulling it."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> PeerLink: ...

    def __exit__(self, *exc: object) -> None: ...


class KVTransport(Protocol):
    """One worker rank's end of the P→D data plane.

    Primitives, in the order a worker uses them:

    - :meth:`register` — both sides: the KV caches pages are read from (P) and written
      into (D), once, before anything moves;
    - :meth:`serve` — P: answer pulls on ``host:port``, asking a :class:`PullHandler`
      (the P side's rules, :mod:`.server`) whether and when to serve;
    - :meth:`connect` — D: a :class:`PeerLink` to one P rank, bounded by the connect
      timeout; :class:`PeerUnreachable` when there is no such peer;
    - :meth:`PeerLink.pull` — D: pull one page slice per block and layer into registered
      memory, bounded by the transfer deadline; :meth:`PeerLink.done` — D needs nothing;
    - :meth:`PeerLink.close`, :meth:`close`.

    With a credential, each transport opens every ``kv_port`` connection with the pool's
    handshake (:mod:`kvpool.security.kv_port`), before the first pull frame
    (:mod:`.pull_port`, shared by both).

    Rules every transport keeps: every wait is bounded (a deadline or the configured
    timeouts), a refusal by P surfaces on D as :class:`~kvpool.errors.TransferError`
    naming P's reason, and a broken stream as :class:`~kvpool.errors.ProtocolError` or
    ``TransferError``: the worker reports any of them as a failed load, so vLLM
    recomputes.
    """

    #: the node config's ``protocol`` this transport answers to
    name: str

    def register(self, caches: PagedCaches | CacheSet) -> None: ...

    def serve(self, host: str, port: int, handler: PullHandler) -> None:
        """Start answering pulls on ``host:port``; ``OSError`` when it cannot listen."""
        ...

    def connect(self, host: str, port: int, timeout_s: float) -> PeerLink: ...

    def close(self) -> None: ...


def _peer(config: TransferConfig, credential: Credential | None) -> PeerSettings:
    """How this rank's pull port answers and dials: the transfer timeout bounds each
    exchange, and a D proves its credential as its engine's decode."""
    client_id = f"decode {config.engine_id}" if config.engine_id else "decode"
    return PeerSettings(config.transfer_timeout_ms / 1000, credential, client_id)


# Each is imported when chosen: the implementations import this module's interface, and
# the Transfer Engine's pulls import the ``mooncake`` wheel only when the caches are
# registered (kvpool.mooncake.mover).
def _tcp(config: TransferConfig, credential: Credential | None) -> KVTransport:
    from kvpool.connectors.transfer.tcp import TcpPullTransport

    return TcpPullTransport(_peer(config, credential))


def _engine(config: TransferConfig, credential: Credential | None) -> KVTransport:
    from kvpool.connectors.transfer.engine import EngineTransport

    return EngineTransport(
        hostname=config.kv_host,
        protocol=config.protocol,
        device_name=config.device_name,
        peer=_peer(config, credential),
    )


# (transport, protocol) -> factory; a new fabric is one more entry (and the node config's
# kvpool.config.fabrics learning how to tell that this machine has it).
TRANSPORTS = {
    (TRANSPORT_KVPOOL, "tcp"): _tcp,
    **{(TRANSPORT_ENGINE, p): _engine for p in ("tcp", *ENGINE_PROTOCOLS)},
}


def make_transport(config: TransferConfig, credential: Credential | None = None) -> KVTransport:
    """The transport the node config names: ``transport`` (by default kvpool's for
    ``tcp``, the Transfer Engine for the other protocols) over ``protocol`` (``tcp``
    without a node config); with ``credential`` its ``kv_port`` connections open with the
    handshake (:mod:`kvpool.security.kv_port`)."""
    transport = config.transport
    if transport is None:
        transport = TRANSPORT_KVPOOL if config.protocol == "tcp" else TRANSPORT_ENGINE
    factory = TRANSPORTS.get((transport, config.protocol))
    if factory is None:
        known = ", ".join(f"{p} ({t})" for t, p in TRANSPORTS)
        raise ConfigError(
            f"protocol: the transfer connector cannot move KV over {config.protocol!r} with"
            f' transport {transport!r} (it has: {known}); set "protocol": "tcp" in the node'
            " config"
        )
    return factory(config, credential)
