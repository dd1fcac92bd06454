"""What the Mooncake e2e tests do inside an offline vLLM process (which runs in the test's
network namespace, beside a real ``mooncake_master``).

- :func:`install` (a spec's ``setup``): opens this process's Mooncake engine as the store
  connector would, wrapped in a :class:`Recorder` that remembers, in order, the keys the
  connector stored — so a test can damage "the second block of the last prompt".
- :func:`damage` (a ``call`` step): removes objects from Mooncake, or flips one payload byte
  of each with Mooncake's own calls (a bad segment), leaving kvpool's header as it was.
- :func:`master_metrics` (a ``call`` step): the master's ``master_*`` Prometheus gauges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.connectors.store.pool import EmbeddedPools
from kvpool.engines import open_engine
from kvpool.errors import KVPoolError
from kvpool.mooncake.settings import MooncakeNodeConfig, load_any_node_config
from kvpool.net import http_get

__all__ = ["Recorder", "damage", "install", "master_metrics"]


class Recorder:
    """A Mooncake engine that remembers the keys stored through it, in order."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.engine = inner.engine
        self.stored: list[str] = []

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        results: list[KVPoolError | None] = self.inner.batch_put_parts(keys, parts, parents=parents)
        for key, error in zip(keys, results, strict=True):
            if error is None and key not in self.stored:
                self.stored.append(key)
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_recorder: Recorder | None = None


def install() -> None:
    """Make the recorded engine the one the store connector opens (before vLLM starts)."""
    global _recorder
    node = load_any_node_config()
    assert isinstance(node, MooncakeNodeConfig), f"not a Mooncake config: {node}"
    _recorder = Recorder(open_engine("mooncake", mooncake=node))
    EmbeddedPools.install(_recorder, f"mooncake:{node.master_server_address}")


def damage(mode: str, start: int, count: int) -> dict[str, Any]:
    """Remove or corrupt ``count`` stored objects from the ``start``-th (0-based) of the
    keys stored so far, counted from the end when ``start`` is negative."""
    from tests.mooncake.host import corrupt

    assert _recorder is not None, "damage needs the setup step install"
    first = start if start >= 0 else len(_recorder.stored) + start
    keys = _recorder.stored[first : first + count]
    for key in keys:
        if mode == "remove":
            assert _recorder.inner.remove(key), key
        elif mode == "corrupt":
            corrupt(_recorder.inner, key)
        else:
            raise ValueError(f"unknown damage {mode!r}")
    return {"damaged": len(keys), "stored": len(_recorder.stored)}


def master_metrics(address: str) -> dict[str, float]:
    """The master's ``master_*`` gauges and counters at ``address`` (its metrics port)."""
    reply = http_get(f"http://{address}/metrics", 5.0)
    assert reply.ok, f"no metrics at {address}: {reply.error}"
    out: dict[str, float] = {}
    for line in reply.text.splitlines():
        if line.startswith("master_") and " " in line:
            name, value = line.split(" ", 1)
            if "{" not in name:
                out[name] = float(value.split()[0])
    return out
