"""Routing for the P/D proxy: which prefill (P) and decode (D) endpoint serves a request.

Pure (no I/O, no clock, no randomness): the server tells it what happened (an endpoint
failed, a health poll succeeded); it keeps the state and decides.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from kvpool.proxy.block_index import BlockIndex

__all__ = [
    "ROUTING_POLICIES",
    "KvAware",
    "LeastInflight",
    "LeastLoaded",
    "PrefixAffinity",
    "Prompt",
    "RoundRobin",
    "Route",
    "RoutingPolicy",
    "Upstream",
    "UpstreamGroup",
    "make_routing_policy",
    "prefix_key",
]

_T = TypeVar("_T")


@dataclass
class Upstream:
    """One OpenAI-compatible endpoint (a vLLM instance) and what the proxy knows of it:
    its health and requests in flight, and (fed by the server) its own load as its
    ``/metrics`` says and the blocks its KV events say it holds."""

    url: str
    healthy: bool = True
    inflight: int = 0
    last_error: str = ""
    waiting: int = 0  # vllm:num_requests_waiting
    running: int = 0  # vllm:num_requests_running
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1
    blocks: BlockIndex | None = None  # its own cache, from its KV events
    trusted: bool = True  # whether its events match what it serves (see kv_feed)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the KV-aware policy sees it: its full blocks' content keys
    (:func:`kvpool.proxy.block_index.content_keys`), its length in tokens, and when it
    is routed (seconds on the server's monotonic clock)."""

    keys: tuple[bytes, ...]
    tokens: int
    now: float = 0.0


@dataclass(slots=True)
class Route:
    """How one request is routed to its prefill: the ``prefix_affinity`` key, the
    ``kv_aware`` prompt, and what to call once an endpoint is picked (with the policy's
    prediction for it) and once it has answered (with its reply)."""

    key: bytes | None = None
    prompt: Prompt | None = None
    on_pick: Callable[[Upstream], None] | None = None
    on_reply: Callable[[Upstream, dict[str, Any]], None] | None = None


class RoutingPolicy(Protocol):
    """Chooses one endpoint among non-empty, healthy candidates."""

    name: str

    def choose(
        self, candidates: Sequence[Upstream], key: bytes | None, prompt: Prompt | None = None
    ) -> Upstream: ...


class _Rotation:
    """Ties rotate: each choice among equals takes the next of them in turn."""

    def __init__(self) -> None:
        self._turn = 0

    def _next(self, tied: Sequence[_T]) -> _T:
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen


class RoundRobin(_Rotation):
    """Each request goes to the next healthy endpoint in turn."""

    name = "round_robin"

    def choose(
        self, candidates: Sequence[Upstream], key: bytes | None, prompt: Prompt | None = None
    ) -> Upstream:
        return self._next(candidates)


class LeastInflight(_Rotation):
    """The endpoint with the fewest requests in flight.  Ties rotate, so an idle cluster
    still spreads its load instead of sending everything to the first endpoint."""

    name = "least_inflight"

    def choose(
        self, candidates: Sequence[Upstream], key: bytes | None, prompt: Prompt | None = None
    ) -> Upstream:
        fewest = min(c.inflight for c in candidates)
        return self._next([c for c in candidates if c.inflight == fewest])


# - Hashes are ``hashlib`` digests, never ``hash()``: every proxy process, whatever its
#   ``PYTHONHASHSEED``, sends a prefix to the same endpoint.
def _score(key: bytes, url: str) -> int:
    digest = hashlib.blake2b(key + b"\x00" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinity:
    """Requests sharing a prompt prefix go to the same endpoint, so its local prefix cache
    hits too.  Rendezvous (highest-random-weight) hashing: each endpoint scores the key and
    the highest score wins, so when an endpoint leaves only the prefixes it owned move.
    A request without a key (nothing to hash) falls back to least in-flight."""

    name = "prefix_affinity"

    def __init__(self) -> None:
        self._fallback = LeastInflight()

    def choose(
        self, candidates: Sequence[Upstream], key: bytes | None, prompt: Prompt | None = None
    ) -> Upstream:
        if not key:
            return self._fallback.choose(candidates, None)
        return max(candidates, key=lambda c: (_score(key, c.url), c.url))


class LeastLoaded(_Rotation):
    """The endpoint with the least work ahead: requests in flight through this proxy and
    waiting in its queue (``/metrics``), then the fuller KV cache last.  Ties rotate.
    A decode instance's choice under ``kv_aware``."""

    name = "least_loaded"

    def choose(
        self, candidates: Sequence[Upstream], key: bytes | None, prompt: Prompt | None = None
    ) -> Upstream:
        def load(c: Upstream) -> tuple[int, float]:
            return c.inflight + c.waiting, round(c.kv_usage, 2)

        least = min(load(c) for c in candidates)
        return self._next([c for c in candidates if load(c) == least])


# The KV-aware choice estimates each candidate's prefill work in blocks:
#
#   cost = blocks to compute + load_cost × blocks to load from the pool + queue + pressure
#
# - blocks to compute: the prompt's full blocks beyond what the candidate's own cache
#   holds and beyond what the pool holds, whichever is longer (its KV events say the
#   first, the pool's the second; a candidate whose events are not trusted holds nothing).
#   What the candidate was just sent counts as held for ``pending_s``: its events come
#   only once it has computed it, and a tenant's next request must not go elsewhere
#   meanwhile;
# - blocks to load: what the pool adds beyond the candidate's own hit, at ``load_cost`` of
#   a computed block (a load is memory bandwidth, a prefill is compute);
# - queue: the work ahead of this request there (in flight through this proxy, waiting in
#   its queue), each request worth the blocks the recent ones were expected to compute;
# - pressure: a KV cache over 90 % full evicts what it holds (and may preempt).
# The least cost wins; ties go to fewer in flight, then rotate.  Without a prompt (no
# token ids) or with no candidate's events, it is least-loaded.
class KvAware(_Rotation):
    """Routes a prompt where its prefill costs least, from what each instance's cache
    and the shared pool hold and how loaded each instance is."""

    name = "kv_aware"

    def __init__(
        self,
        pool: BlockIndex | None = None,
        *,
        load_cost: float = 0.1,
        pending_s: float = 10.0,
        max_pending: int = 100_000,
    ) -> None:
        super().__init__()
        self.pool = pool
        self.load_cost = load_cost
        self.pending_s = pending_s
        self.max_pending = max_pending
        self._work = 4.0  # blocks a request is expected to compute (recent average)
        self._fallback = LeastLoaded()
        # url -> content key -> until when it counts as held (sent, not yet in its events)
        self._pending: dict[str, dict[bytes, float]] = {}
        # what the last choice expected of each candidate: url -> (own hit, pool hit), blocks
        self.predicted: dict[str, tuple[int, int]] = {}

    def _sent(self, url: str, keys: Sequence[bytes], now: float) -> int:
        """How many of ``keys`` from the first on were sent to ``url`` lately."""
        pending = self._pending.get(url)
        if not pending:
            return 0
        n = 0
        for key in keys:
            if pending.get(key, 0.0) <= now:
                break
            n += 1
        return n

    def _remember(self, url: str, keys: Sequence[bytes], now: float) -> None:
        pending = self._pending.setdefault(url, {})
        if len(pending) + len(keys) > self.max_pending:  # the expired go first, then all
            for key in [k for k, until in pending.items() if until <= now]:
                del pending[key]
            if len(pending) + len(keys) > self.max_pending:
                pending.clear()
        until = now + self.pending_s
        for key in keys:
            pending[key] = until

    def choose(
        self, candidates: Sequence[Upstream], key: bytes | None, prompt: Prompt | None = None
    ) -> Upstream:
        self.predicted = {}
        if prompt is None or not any(c.blocks is not None for c in candidates):
            return self._fallback.choose(candidates, key)
        keys, now = prompt.keys, prompt.now
        n = len(keys)
        pool_hit = self.pool.prefix(keys) if self.pool is not None else 0
        costs, computes = [], []
        for c in candidates:
            own = 0
            if c.blocks is not None and c.trusted:  # what it says, and what it was sent
                own = max(c.blocks.prefix(keys), self._sent(c.url, keys, now))
            self.predicted[c.url] = (own, pool_hit)
            compute = n - max(own, pool_hit)
            loaded = max(0, pool_hit - own)
            queue = (c.inflight + c.waiting) * self._work
            pressure = n if c.kv_usage > 0.9 else 0.0
            costs.append(compute + self.load_cost * loaded + queue + pressure)
            computes.append(compute)
        best = min(costs)
        tied = [i for i, cost in enumerate(costs) if cost - best < 1e-9]
        fewest = min(candidates[i].inflight for i in tied)
        tied = [i for i in tied if candidates[i].inflight == fewest]
        index = self._next(tied)
        chosen = candidates[index]
        self._work = 0.9 * self._work + 0.1 * max(computes[index], 1)
        self._remember(chosen.url, keys, now)
        return chosen


_POLICY_CLASSES = type[RoundRobin] | type[LeastInflight] | type[PrefixAffinity]
_ROUTING_POLICIES: Mapping[str, _POLICY_CLASSES | type[KvAware] | type[LeastLoaded]] = (
    MappingProxyType(
        {
            RoundRobin.name: RoundRobin,
            LeastInflight.name: LeastInflight,
            PrefixAffinity.name: PrefixAffinity,
            KvAware.name: KvAware,
            LeastLoaded.name: LeastLoaded,
        }
    )
)
ROUTING_POLICIES: tuple[str, ...] = tuple(_ROUTING_POLICIES)


def make_routing_policy(name: str) -> RoutingPolicy:
    """A fresh routing policy by name; ``ValueError`` names the choices."""
    try:
        return _ROUTING_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {', '.join(ROUTING_POLICIES)}"
        ) from None


# - Only healthy endpoints are candidates.  An endpoint goes down on a connect failure, a 5xx
#   or a failing health poll, and comes back only when a health poll succeeds.
# - ``acquire`` and ``release`` come in pairs; the in-flight count never goes below zero.
class UpstreamGroup:
    """The endpoints of one role (prefill or decode) and the policy that picks among them."""

    def __init__(self, role: str, urls: Iterable[str], policy: RoutingPolicy) -> None:
        self.role = role
        self.policy = policy
        self.upstreams: list[Upstream] = [Upstream(url) for url in urls]
        if not self.upstreams:
            raise ValueError(f"no {role} endpoint given")
        if len({u.url for u in self.upstreams}) != len(self.upstreams):
            raise ValueError(f"duplicate {role} endpoint in {[u.url for u in self.upstreams]}")

    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def pick(
        self,
        key: bytes | None = None,
        exclude: frozenset[str] = frozenset(),
        prompt: Prompt | None = None,
    ) -> Upstream | None:
        """The endpoint for the next request, or ``None`` when no healthy one is left
        (``exclude`` holds the urls this request already failed on)."""
        candidates = [u for u in self.upstreams if u.healthy and u.url not in exclude]
        if not candidates:
            return None
        return self.policy.choose(candidates, key, prompt)

    def acquire(self, upstream: Upstream) -> None:
        upstream.inflight += 1

    def release(self, upstream: Upstream) -> None:
        upstream.inflight = max(0, upstream.inflight - 1)

    def get(self, url: str) -> Upstream:
        for u in self.upstreams:
            if u.url == url:
                return u
        raise KeyError(url)

    def mark_down(self, url: str, reason: str) -> bool:
        """Take the endpoint out of rotation; True when it was in rotation before."""
        upstream = self.get(url)
        was_healthy = upstream.healthy
        upstream.healthy = False
        upstream.last_error = reason
        return was_healthy

    def mark_up(self, url: str) -> bool:
        """Put the endpoint back in rotation; True when it was out before."""
        upstream = self.get(url)
        was_down = not upstream.healthy
        upstream.healthy = True
        upstream.last_error = ""
        return was_down


def _content_text(content: Any) -> str:
    """Chat content is a string or a list of parts; non-text parts hash by their JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            else:
                pieces.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(pieces)
    return "" if content is None else json.dumps(content, sort_keys=True)


def prefix_key(body: dict[str, Any], n: int) -> bytes | None:
    """The first ``n`` characters of the prompt (or ``n`` token ids of a tokenized prompt),
    as bytes to hash; ``None`` when the request has nothing to hash.  Chat messages are
    rendered as ``role\\x1fcontent\\x1e`` each, so the system prompt leads the key."""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):  # one tokenized prompt
                return ",".join(str(t) for t in prompt[:n]).encode() or None
            prompt = first  # a batch: the first prompt decides
        if isinstance(prompt, list):  # a batch of tokenized prompts
            return ",".join(str(t) for t in prompt[:n]).encode() or None
        if isinstance(prompt, str):
            return prompt[:n].encode() or None
        return None
    messages = body.get("messages")
    if isinstance(messages, list):
        text = "".join(
            f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e"
            for m in messages
            if isinstance(m, dict)
        )
        return text[:n].encode() or None
    return None
