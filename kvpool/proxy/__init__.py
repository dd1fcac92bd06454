"""The P/D proxy: an OpenAI-compatible front that sends each request to a prefill
endpoint (``max_tokens=1``), passes its token on at once, and has a decode endpoint
continue the answer, streamed back.
"""

from __future__ import annotations

from kvpool.proxy.config import ProxyConfig
from kvpool.proxy.routing import ROUTING_POLICIES, UpstreamGroup, make_routing_policy, prefix_key
from kvpool.proxy.run import run_proxy, serve
from kvpool.proxy.server import ProxyServer

__all__ = [
    "ROUTING_POLICIES",
    "ProxyConfig",
    "ProxyServer",
    "UpstreamGroup",
    "make_routing_policy",
    "prefix_key",
    "run_proxy",
    "serve",
]
