"""The public API is ``kvpool.__all__``: pinned here, both directions (as httpx's
``tests/test_exported_members.py`` does), so a name is added or removed on purpose."""

from __future__ import annotations

import subprocess
import sys
import types

import kvpool
import kvpool.errors

PUBLIC = [
    "AsyncClient",
    "AuthError",
    "BlockKey",
    "ChecksumMismatch",
    "Client",
    "ConfigError",
    "EmbeddedPool",
    "KVPoolError",
    "KeyNamespace",
    "NoSpace",
    "NotLeader",
    "ObjectBusy",
    "ObjectNotFound",
    "Overloaded",
    "PeerTimeout",
    "PoolError",
    "ProtocolError",
    "QuotaExceeded",
    "StaleWrite",
    "TLSConfig",
    "TransferError",
    "UnknownClient",
    "UnknownSegment",
    "WriteConflict",
    "__version__",
    "chunk_keys",
]


def test_all_is_the_pinned_list() -> None:
    assert kvpool.__all__ == PUBLIC


def test_every_exported_name_exists_and_nothing_else_is_public() -> None:
    for name in kvpool.__all__:
        assert hasattr(kvpool, name), name
    public = {
        n
        for n, v in vars(kvpool).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public - {"annotations"} - set(kvpool.__all__) == set()
    assert set(kvpool.__all__) <= set(dir(kvpool))


def test_the_clients_are_the_service_classes() -> None:
    from kvpool.client.async_client import AsyncClient
    from kvpool.client.client import Client
    from kvpool.embedded import EmbeddedPool

    assert kvpool.Client is Client
    assert kvpool.AsyncClient is AsyncClient
    assert kvpool.EmbeddedPool is EmbeddedPool
    assert issubclass(kvpool.EmbeddedPool, kvpool.Client)


def test_tls_config_is_the_one_the_client_takes() -> None:
    # docs/security.md tells a client to pass ``tls=TLSConfig(ca=...)``: it must be
    # importable from the package itself, not only from an internal module.
    from kvpool.security.tls import TLSConfig

    assert kvpool.TLSConfig is TLSConfig
    assert kvpool.TLSConfig(ca="/etc/kvpool/ca.pem").enabled


def test_the_whole_error_tree_is_exported() -> None:
    tree = {
        getattr(kvpool.errors, n)
        for n in kvpool.errors.__all__
        if isinstance(getattr(kvpool.errors, n), type)
    }
    assert tree == {getattr(kvpool, n) for n in kvpool.__all__ if getattr(kvpool, n) in tree}
    assert tree == set(kvpool.errors._BY_CODE.values())


def test_import_kvpool_is_light() -> None:
    code = (
        "import sys, kvpool\n"
        "heavy = [m for m in ('vllm', 'torch', 'numpy', 'prometheus_client', 'aiohttp',"
        " 'kvpool.client.client') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
