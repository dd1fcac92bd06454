"""The small network helpers every part of kvpool shares (standard library only).

:func:`http_get`'s failure is a value, not an exception, for the tools that report what
they found (``doctor``, ``status``, ``up``'s health waits).
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MASTER_PORT",
    "HttpReply",
    "free_port",
    "free_port_runs",
    "http_get",
    "https_context",
    "master_scheme",
    "port_free",
    "split_address",
]

# The master's one port for RPC and HTTP: Mooncake's 50088, as in the production guide.
DEFAULT_MASTER_PORT = 50088


def split_address(address: str, default_port: int = DEFAULT_MASTER_PORT) -> tuple[str, int]:
    """``host:port`` → (host, port); a bare host gets ``default_port``, an empty host
    means 127.0.0.1, IPv6 brackets are dropped.  A port that is not a number is a
    :class:`ValueError` (config parsers turn that into a :class:`~kvpool.errors.ConfigError`
    naming their key)."""
    text = address.strip()
    if text.startswith("[") and "]" in text:  # [v6] or [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # a bare host name, IPv4 address or unbracketed IPv6 address
        host, port = text, ""
    return host or "127.0.0.1", int(port) if port else default_port


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` can be bound now (nobody listens there)."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port_runs(host: str, lengths: Sequence[int], tries: int = 64) -> list[int]:
    """For each length ``n``, the first of ``n`` consecutive ports free on ``host``, no
    two runs overlapping: every port tried stays bound until all runs are found, so a
    run is never handed out twice (a vLLM instance's ranks listen on kv_port + rank).

    Ports come from below the kernel's ephemeral range where it leaves room: a port in
    it can be taken by any outgoing connection before its server binds it, and a probe
    of it can connect to itself."""
    held: list[socket.socket] = []

    def bind(port: int) -> int | None:
        probe = socket.socket()
        try:
            probe.bind((host, port))
        except OSError:
            probe.close()
            return None
        held.append(probe)
        return int(probe.getsockname()[1])

    try:
        bases: list[int] = []
        for n in lengths:
            bases.append(_free_run(bind, n, tries, _below_ephemeral(n)))
            if bases[-1] < 0:
                raise OSError(f"no {n} consecutive free ports on {host} in {tries} tries")
        return bases
    finally:
        for probe in held:
            probe.close()


def _ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports (Linux's default if unreadable)."""
    try:
        low, high = (int(part) for part in Path(path).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _below_ephemeral(n: int) -> range | None:
    """Where a run of ``n`` starts under the ephemeral range, None if that is too small."""
    low, _ = _ephemeral_range()
    first, last = max(1024, low - 16384), low - n  # 16,384 ports: collisions stay rare
    return range(first, last + 1) if last - first >= 1024 else None


def _free_run(
    bind: Callable[[int], int | None], n: int, tries: int, bases: range | None = None
) -> int:
    """The first port of ``n`` that ``bind`` could take, consecutive; -1 if none.  A base
    is drawn from ``bases`` when given, else the kernel picks it."""
    for _ in range(tries):
        base = bind(random.choice(bases) if bases is not None else 0)
        if base is None:
            if bases is not None:
                continue  # taken: draw again
            return -1  # the kernel has no free port left to pick
        if all(p <= 65535 and bind(p) is not None for p in range(base + 1, base + n)):
            return base
    return -1


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free on ``host`` at this moment (below the ephemeral
    range where it can, as :func:`free_port_runs`)."""
    return free_port_runs(host, [1])[0]


@dataclass(frozen=True)
class HttpReply:
    """What one GET found: ``status`` is None when no HTTP answer came at all, and
    ``error`` says why in a line (refused, timed out, ``HTTP 404 Not Found``)."""

    status: int | None
    body: bytes
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def master_scheme(env: Mapping[str, str] | None = None) -> str:
    """``https`` when this process is configured for a TLS pool (KVPOOL_TLS_CA set: a
    master with --tls_cert serves HTTPS on its one port), else ``http``."""
    env = os.environ if env is None else env
    return "https" if env.get("KVPOOL_TLS_CA") else "http"


def https_context(ca: str | None = None) -> ssl.SSLContext:
    """A verifying client context for an HTTPS GET: ``ca`` (``None``: KVPOOL_TLS_CA,
    else the system's trust store) verifies the server, and KVPOOL_TLS_CERT/KEY, when
    set, are the client certificate a master with --tls_ca asks for."""
    ca = os.environ.get("KVPOOL_TLS_CA", "") if ca is None else ca
    context = ssl.create_default_context(cafile=ca or None)
    cert, key = os.environ.get("KVPOOL_TLS_CERT", ""), os.environ.get("KVPOOL_TLS_KEY", "")
    if cert and key:
        context.load_cert_chain(cert, key)
    return context


def http_get(
    url: str,
    timeout_s: float = 3.0,
    *,
    max_bytes: int = 4 << 20,
    headers: Mapping[str, str] | None = None,
    ca: str | None = None,
) -> HttpReply:
    """GET ``url`` (with ``headers``, e.g. the operator's bearer token), reading at most
    ``max_bytes`` of the body; never raises for network trouble (a timeout, a refusal, an
    HTTP error status are all in the reply)."""
    try:
        request = urllib.request.Request(url, headers=dict(headers or {}))
        context = https_context(ca) if url.startswith("https://") else None
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as reply:
            return HttpReply(reply.status, reply.read(max_bytes))
    except urllib.error.HTTPError as exc:
        return HttpReply(exc.code, b"", f"HTTP {exc.code} {exc.reason}")
    except http.client.HTTPException as exc:
        # Not HTTP on the other end: also what a probe of an unused ephemeral port reads
        # when the kernel connects the socket to itself and it hears its own request.
        return HttpReply(None, b"", f"not an HTTP answer: {exc!r}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            return HttpReply(None, b"", f"no answer in {timeout_s:g} s")
        return HttpReply(None, b"", str(reason))
