"""The edge of doctor: sockets, HTTP, disks and subprocesses, each bounded by a timeout.

Every function returns facts (or an error string) and never raises for the condition it
probes, so a broken cluster yields a report rather than a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvpool.core.keys import KeyNamespace, chunk_keys
from kvpool.errors import AuthError, ConfigError, KVPoolError
from kvpool.mooncake.master import find_mooncake_master, looks_like_mooncake_health
from kvpool.mooncake.sniff import mooncake_answers
from kvpool.net import http_get, master_scheme, split_address
from kvpool.ops.doctor.checks_host import SsdFacts
from kvpool.ops.doctor.checks_node import MasterFacts
from kvpool.ops.doctor.checks_security import MasterAuthFacts, SecretFileFacts
from kvpool.security.credentials import Credential
from kvpool.security.secret import operator_headers, read_secret_file
from kvpool.security.socket_auth import authenticate
from kvpool.security.socket_tls import wrap_client
from kvpool.security.tls import TLSConfig

__all__ = [
    "CROSS_NODE_KEY",
    "PROBE_NAMESPACE",
    "PROBE_TOKENS",
    "address_is_local",
    "cross_node_probe",
    "key_probe",
    "local_probe_keys",
    "master_auth_probe",
    "port_bind_error",
    "probe_master",
    "rdma_devices",
    "secret_file_facts",
    "ssd_facts",
    "tcp_connect_error",
]

# A fixed probe: any change to the key function changes these keys on every node alike.
PROBE_NAMESPACE = KeyNamespace(model="kvpool-doctor-probe", kv_dtype="bfloat16", chunk_size=16)
PROBE_TOKENS = tuple(range(1000, 1064))
_MAX_TIER_FILES = 200_000


def tcp_connect_error(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def rdma_devices(root: str = "/sys/class/infiniband") -> tuple[str, ...] | None:
    """The host's RDMA devices (the names ``device_name`` takes); None when the kernel
    exposes no such directory (no RDMA stack loaded)."""
    try:
        return tuple(sorted(entry.name for entry in os.scandir(root)))
    except OSError:
        return None


def probe_master(
    address: str,
    timeout_s: float = 3.0,
    *,
    metrics_port: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> MasterFacts:
    """TCP connect, then GET /health, /metrics and /api/status on the same port (the master
    serves its RPC and HTTP on one port).  When that is no kvpool master, look for a real
    mooncake_master: its metrics port is ``metrics_port`` (from its command line), the
    address itself or 9003 beside its RPC port (an HTTP GET on Mooncake's RPC port is
    closed without an answer); an RPC port that answers coro_rpc is named as Mooncake's
    even when its metrics port is not found.  ``headers``: the operator's (its token),
    None: from this process's environment."""
    try:
        host, port = split_address(address)
    except ValueError:
        return MasterFacts(address, f"{address!r} is not host:port")
    error = tcp_connect_error(host, port, timeout_s)
    if error is not None:
        return MasterFacts(address, error)
    health = http_get(f"{master_scheme()}://{address}/health", timeout_s)
    if health.status != 200 or looks_like_mooncake_health(health.text) is not None:
        mooncake, why = None, ""
        if metrics_port is not None:
            mooncake, why = find_mooncake_master(f"{host}:{metrics_port}", timeout_s)
        if mooncake is None:
            mooncake, why = find_mooncake_master(address, timeout_s)
        if mooncake is not None:
            return MasterFacts(address, None, health.status, None, mooncake=mooncake)
        error = health.error
        if health.status is None and mooncake_answers(address, timeout_s):
            return MasterFacts(address, None, None, why, mooncake_rpc=True)
        if health.status is None:
            error = f"{error} (no HTTP answer; and no Mooncake master: {why})"
        return MasterFacts(address, None, health.status, error)
    operator = dict(headers) if headers is not None else operator_headers(os.environ)
    metrics = http_get(f"{master_scheme()}://{address}/metrics", timeout_s, headers=operator)
    status = http_get(f"{master_scheme()}://{address}/api/status", timeout_s, headers=operator)
    snapshot = None
    if status.status == 200:
        try:
            parsed = json.loads(status.text)
        except json.JSONDecodeError:
            parsed = None
        snapshot = parsed if isinstance(parsed, dict) else None
    locked = metrics.status == 401
    return MasterFacts(
        address, None, health.status, None, metrics.text, snapshot, metrics_locked=locked
    )


def port_bind_error(port: int, host: str = "127.0.0.1") -> str | None:
    """None when ``port`` can be bound now.  Binding 127.0.0.1 also fails when another
    process listens on 0.0.0.0 (no SO_REUSEADDR, so a TIME_WAIT leftover does not count)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        sock.close()


def address_is_local(host: str) -> str | None:
    """None when ``host`` resolves to an address of this machine (bind to port 0 succeeds)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host}: {exc.strerror or exc}"
    last = "no address"
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(sockaddr)
            return None
        except OSError as exc:
            last = exc.strerror or str(exc)
        finally:
            sock.close()
    return last


def ssd_facts(path: str) -> SsdFacts:
    p = Path(path)
    if not p.exists():
        return SsdFacts(path, False, False, False, None)
    if not p.is_dir():
        return SsdFacts(path, True, False, False, None)
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".kvpool-doctor-"):
            writable = True
    except OSError:
        writable = False
    free = shutil.disk_usage(p).free
    return SsdFacts(path, True, True, writable, free, _tree_bytes(p))


def _tree_bytes(root: Path) -> int:
    """Bytes in files under ``root`` (bounded walk: a huge tree is counted partially)."""
    total = 0
    seen = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            seen += 1
            if seen > _MAX_TIER_FILES:
                return total
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


_PROBE_SCRIPT = (
    "import json; from kvpool.ops.doctor.probes import local_probe_keys;"
    " print(json.dumps(local_probe_keys()))"
)


def local_probe_keys() -> list[str]:
    return [k.hex for k in chunk_keys(PROBE_TOKENS, PROBE_NAMESPACE)]


def key_probe(
    seeds: Sequence[str] = ("0", "1", "random"), timeout_s: float = 30.0
) -> dict[str, list[str] | str]:
    """The probe keys computed here and in one subprocess per PYTHONHASHSEED value."""
    results: dict[str, list[str] | str] = {"this process": local_probe_keys()}
    procs: dict[str, subprocess.Popen[str]] = {}
    for hash_seed in seeds:
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        procs[f"PYTHONHASHSEED={hash_seed}"] = subprocess.Popen(
            [sys.executable, "-c", _PROBE_SCRIPT],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for label, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            results[label] = f"no answer within {timeout_s:.0f} s"
            continue
        if proc.returncode != 0:
            results[label] = (err.strip().splitlines() or ["exit " + str(proc.returncode)])[-1]
            continue
        try:
            results[label] = [str(k) for k in json.loads(out)]
        except json.JSONDecodeError:
            results[label] = f"unreadable output {out[:80]!r}"
    return results


# The pool object through which nodes compare their probe keys (see cross_node_probe).
CROSS_NODE_KEY = "kvpool-doctor/key-probe-v1"


def cross_node_probe(
    master: str,
    host: str,
    version: str,
    timeout_s: float = 2.0,
    *,
    credential: Credential | None = None,
) -> tuple[dict[str, object] | None, bool, str | None]:
    """Compare block keys with other nodes through the pool: the first node to run doctor
    publishes its probe keys under CROSS_NODE_KEY; every later one reads them.

    ``credential``: this host's (None: the environment's, as any Client).
    Returns (what another node published or None, whether this run published, error).
    Writes one small object into the pool; a duplicate put is a no-op by the pool's rules.
    """
    try:
        from kvpool.client.client import Client
        from kvpool.errors import KVPoolError, ObjectNotFound
    except ImportError as exc:  # the service layer is not installed here
        return None, False, f"no pool client ({exc})"
    mine = {"host": host, "version": version, "keys": local_probe_keys()}
    try:
        with Client(master, timeout_s=timeout_s, credential=credential) as client:
            try:
                other = json.loads(client.get(CROSS_NODE_KEY))
            except ObjectNotFound:
                client.put(CROSS_NODE_KEY, json.dumps(mine).encode())
                return None, True, None
    except (KVPoolError, OSError, ValueError) as exc:
        return None, False, f"{type(exc).__name__}: {exc}"
    if not isinstance(other, dict):
        return None, False, f"{CROSS_NODE_KEY} holds something else than a key probe"
    return other, False, None


def secret_file_facts(source: str, path: str) -> SecretFileFacts:
    """A secret file as the processes would read it (kvpool.security.secret's own loader)."""
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    if mode is None:
        return SecretFileFacts(source, path, None)
    try:
        credential = read_secret_file(path, source)
    except ConfigError as exc:
        return SecretFileFacts(source, path, mode, str(exc))
    if credential.is_tenant:
        holds = f"tenant {credential.tenant}'s credential"
    else:
        holds = (
            "the cluster secret"
            if credential.is_cluster
            else f"node {credential.node_id}'s credential"
        )
    return SecretFileFacts(source, path, mode, holds=holds)


def master_auth_probe(
    address: str, credential: Credential | None, timeout_s: float = 3.0
) -> MasterAuthFacts:
    """The handshake with the master's RPC port, as this host's processes would run it: a
    cluster secret proves itself as a client, a node credential as its node.  Without a
    credential: whether the master's operator endpoint asks for one (HTTP 401)."""
    if credential is None:
        reply = http_get(f"{master_scheme()}://{address}/api/status", timeout_s)
        return MasterAuthFacts(address, "", required=reply.status == 401)
    role = "client" if credential.is_cluster else "node"
    client_id = f"client-doctor-{uuid.uuid4().hex[:8]}" if role == "client" else credential.node_id
    if credential.is_tenant:  # a tenant's client proves its tenant
        role, client_id = "tenant", credential.tenant
    try:
        host, port = split_address(address)
        where = f"the master at {address}"
        tls = TLSConfig.from_env().client_context()  # a TLS master: KVPOOL_TLS_CA
        sock = socket.create_connection((host, port), timeout=timeout_s)
        if tls is not None:
            sock = wrap_client(sock, tls, host, timeout_s, where)
        with sock:
            authenticate(sock, credential, role, client_id, timeout_s, where)
    except (AuthError, KVPoolError, OSError, ValueError) as exc:
        return MasterAuthFacts(address, role, f"{type(exc).__name__}: {exc}")
    return MasterAuthFacts(address, role)
