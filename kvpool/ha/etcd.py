"""A small client of etcd's v3 HTTP/JSON gateway: leases, keys and one transaction.

The gateway (etcd 3.4 and later) spares a gRPC stack for the few calls an election needs.
Every call is bounded by ``timeout_s`` and tries each endpoint in turn, so one member of
an etcd cluster being down costs one timeout, not the election.
"""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import PeerTimeout, TransferError

__all__ = ["Etcd", "KeyValue", "parse_endpoints"]


def parse_endpoints(text: str) -> tuple[str, ...]:
    """``host:port[,host:port...]`` (``;`` also separates, as Mooncake writes its
    ``--etcd_endpoints``; ``http://`` is optional) → base URLs."""
    out = []
    for part in text.replace(";", ",").split(","):
        part = part.strip().rstrip("/")
        if part:
            out.append(part if "://" in part else f"http://{part}")
    return tuple(out)


# The gateway's JSON mapping: keys and values travel base64-encoded, 64-bit integers
# (lease ids, TTLs) as strings.
def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: str
    create_revision: int
    lease: int


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(
        _unb64(item["key"]),
        _unb64(item.get("value", "")),
        int(item.get("create_revision", 0)),
        int(item.get("lease", 0)),
    )


class Etcd:
    """etcd's gateway at ``endpoints`` (base URLs); thread-safe (no shared state but the
    endpoint that answered last, which is only a hint)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self._first = 0

    # ---------------------------------------------------------------------------- leases
    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        return int(self._post("/v3/lease/grant", {"TTL": str(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the TTL it has again, 0 when it expired already."""
        reply = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", reply).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: its keys go at once (a clean hand-over)."""
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    # ------------------------------------------------------------------------------ keys
    def get(self, key: str) -> KeyValue | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        reply = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return [_kv(item) for item in reply.get("kvs", [])]

    def put(self, key: str, value: str, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._post("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key)})

    def create(
        self, key: str, value: str, lease: int, lists: Sequence[str] = ()
    ) -> tuple[bool, KeyValue | None, int, list[list[KeyValue]]]:
        """Put ``key`` only if it does not exist, and read the keys under each prefix of
        ``lists``, in one transaction (one round trip, where a slow etcd makes each count):
        (created, the key as it stands when it was not, the store's revision after the
        call, each prefix's keys after it).  A created key's create revision is that
        revision."""
        ranges = [
            {"request_range": {"key": _b64(prefix), "range_end": _prefix_end(prefix)}}
            for prefix in lists
        ]
        reply = self._post(
            "/v3/kv/txn",
            {
                "compare": [
                    {
                        "key": _b64(key),
                        "result": "EQUAL",
                        "target": "CREATE",
                        "create_revision": "0",
                    }
                ],
                "success": [
                    {"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}},
                    *ranges,
                ],
                "failure": [{"request_range": {"key": _b64(key)}}, *ranges],
            },
        )
        revision = int(reply["header"]["revision"])
        responses = reply.get("responses", [])
        listed = [
            [_kv(item) for item in r.get("response_range", {}).get("kvs", [])]
            for r in responses[1:]
        ]
        if reply.get("succeeded"):
            return True, None, revision, listed
        kvs = responses[0]["response_range"].get("kvs", [])
        return False, (_kv(kvs[0]) if kvs else None), revision, listed

    # ------------------------------------------------------------------------- transport
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        failures = []
        n = len(self.endpoints)
        for i in range(n):
            at = (self._first + i) % n
            url = self.endpoints[at] + path
            request = urllib.request.Request(
                url, data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    reply: dict[str, Any] = json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as exc:
                # etcd answered: a refusal (an unknown lease, ...) is the same on any member
                detail = exc.read().decode(errors="replace")[:200]
                raise TransferError(f"etcd {url}: HTTP {exc.code}: {detail}") from None
            except (OSError, ValueError, http.client.HTTPException) as exc:
                failures.append(f"{self.endpoints[at]}: {exc}")
                continue
            if "error" in reply and "header" not in reply and "result" not in reply:
                raise TransferError(f"etcd {url}: {reply.get('error')}")
            self._first = at
            return reply
        if all("timed out" in f for f in failures):
            raise PeerTimeout("etcd did not answer: " + "; ".join(failures))
        raise TransferError("cannot reach etcd: " + "; ".join(failures))
