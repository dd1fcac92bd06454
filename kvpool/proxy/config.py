"""Typed configuration of the P/D proxy.  Checked once at construction; every problem is a
:class:`~kvpool.errors.ConfigError` that names the flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvpool.errors import ConfigError
from kvpool.proxy.auth import ENV_API_KEY_FILE, check_key
from kvpool.proxy.kv_feed import EventSource
from kvpool.proxy.routing import ROUTING_POLICIES
from kvpool.security.secret import is_loopback

__all__ = ["FIRST_TOKEN_FROM", "ProxyConfig", "normalize_url"]

FIRST_TOKEN_FROM = ("prefill", "decode")


def normalize_url(flag: str, url: str) -> str:
    """``http://host:port`` without a trailing slash; anything else names the flag."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag}: {url!r} is not an http(s)://host:port URL")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ConfigError(f"{flag}: {url!r} has an invalid port") from None
    if parts.query or parts.fragment:
        raise ConfigError(f"{flag}: {url!r} must not carry a query or fragment")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


@dataclass(frozen=True)
class ProxyConfig:
    """Everything ``kvpool proxy`` needs; ``port=0`` picks a free port (tests, ``kvpool up``)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    # D has no local prefix cache to aim at (it reads P's KV), so prefix_affinity on P
    # pairs with least_inflight on D unless a D policy is given.
    decode_policy: str | None = None
    prefix_chars: int = 256
    connect_timeout_s: float = 5.0
    # per read, not per request: a long generation is fine, a silent peer is a timeout
    read_timeout_s: float = 300.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    shutdown_timeout_s: float = 10.0
    max_connections: int = 1024
    # Any of these in "Authorization: Bearer ..." passes /v1/* (docs/proxy.md#api-keys);
    # none: the proxy answers anyone, which only loopback or --insecure allow.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # sent on to P and D; None: the first of api_keys, or else the client's own header
    upstream_api_key: str | None = field(default=None, repr=False)
    insecure: bool = False  # serve beyond loopback without an API key
    open_metrics: bool = False  # /metrics without the key, for a scraper
    # "prefill": the client gets P's token at once and D continues from it; "decode":
    # D answers the original request and the client gets D's tokens only (two full legs)
    first_token_from: str = "prefill"
    # kv_aware: each prefill's KV event stream (kvpool.proxy.kv_feed.EventSource), and how
    # many blocks the proxy remembers per instance and for the pool
    kv_events: tuple[EventSource, ...] = ()
    kv_max_blocks: int = 200_000
    kv_pool: bool = True  # kv_aware counts the pool's holdings (False: own caches only)

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("--prefill: give at least one prefill endpoint URL")
        if not self.decode:
            raise ConfigError("--decode: give at least one decode endpoint URL")
        prefill = tuple(normalize_url("--prefill", u) for u in self.prefill)
        decode = tuple(normalize_url("--decode", u) for u in self.decode)
        for flag, urls in (("--prefill", prefill), ("--decode", decode)):
            if len(set(urls)) != len(urls):
                raise ConfigError(f"{flag}: the same URL is given twice: {list(urls)}")
        object.__setattr__(self, "prefill", prefill)
        object.__setattr__(self, "decode", decode)
        for flag, policy in (("--policy", self.policy), ("--decode-policy", self.decode_policy)):
            if policy is not None and policy not in ROUTING_POLICIES:
                raise ConfigError(f"{flag}: {policy!r} is not one of {', '.join(ROUTING_POLICIES)}")
        if self.policy == "kv_aware" and not self.kv_events:
            raise ConfigError(
                "--policy kv_aware: give each prefill's KV events with --kv-events"
                " URL=ENDPOINT[,REPLAY] (vLLM's --kv-events-config)"
            )
        sources = tuple(
            EventSource(normalize_url("--kv-events", s.url), s.endpoint, s.replay)
            for s in self.kv_events
        )
        object.__setattr__(self, "kv_events", sources)
        unknown = sorted({s.url for s in sources} - set(prefill))
        if unknown:
            raise ConfigError(f"--kv-events: {unknown} are not --prefill endpoints")
        if self.kv_max_blocks < 1:
            raise ConfigError(f"--kv-max-blocks: must be at least 1, got {self.kv_max_blocks}")
        if self.first_token_from not in FIRST_TOKEN_FROM:
            raise ConfigError(
                f"--first-token-from: {self.first_token_from!r} is not one of "
                f"{', '.join(FIRST_TOKEN_FROM)}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port: {self.port} is not a TCP port")
        if self.prefix_chars < 1:
            raise ConfigError(f"--prefix-chars: must be at least 1, got {self.prefix_chars}")
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections: must be at least 1, got {self.max_connections}")
        for flag, value in (
            ("--connect-timeout", self.connect_timeout_s),
            ("--read-timeout", self.read_timeout_s),
            ("--health-interval", self.health_interval_s),
            ("--health-timeout", self.health_timeout_s),
            ("--shutdown-timeout", self.shutdown_timeout_s),
        ):
            if not value > 0:
                raise ConfigError(f"{flag}: must be a positive number of seconds, got {value}")
        object.__setattr__(
            self, "api_keys", tuple(check_key("--api-key", k) for k in self.api_keys)
        )
        if self.upstream_api_key is not None:
            key = check_key("--upstream-api-key", self.upstream_api_key, min_chars=1)
            object.__setattr__(self, "upstream_api_key", key)
        # before anything binds: an open proxy beyond loopback hands out every P and D
        if not self.api_keys and not self.insecure and not is_loopback(self.host):
            raise ConfigError(
                f"--host {self.host}: a proxy reachable from other hosts without an API key "
                f"serves anyone who can reach it; set --api-key-file (or {ENV_API_KEY_FILE}) "
                "to a file holding the key, or pass --insecure to run it open"
            )

    @property
    def effective_upstream_key(self) -> str | None:
        """The key the proxy sends to P and D, or None to pass on the client's header."""
        if self.upstream_api_key is not None:
            return self.upstream_api_key
        return self.api_keys[0] if self.api_keys else None

    @property
    def effective_decode_policy(self) -> str:
        if self.decode_policy is not None:
            return self.decode_policy
        if self.policy == "kv_aware":  # D reads P's KV: only its load matters
            return "least_loaded"
        return "least_inflight" if self.policy == "prefix_affinity" else self.policy
