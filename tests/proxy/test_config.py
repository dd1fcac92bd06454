from __future__ import annotations

from typing import Any

import pytest

from kvpool.errors import ConfigError
from kvpool.proxy.config import ProxyConfig

P = ("http://127.0.0.1:8100",)
D = ("http://127.0.0.1:8200",)


def test_urls_are_normalized() -> None:
    cfg = ProxyConfig(prefill=("http://127.0.0.1:8100/",), decode=(" http://h:1 ",))
    assert cfg.prefill == ("http://127.0.0.1:8100",)
    assert cfg.decode == ("http://h:1",)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"prefill": ()}, "--prefill"),
        ({"decode": ()}, "--decode"),
        ({"prefill": ("127.0.0.1:8100",)}, "--prefill"),
        ({"decode": ("http://h:99999",)}, "--decode"),
        ({"decode": ("http://h:1?x=1",)}, "--decode"),
        ({"prefill": P + P}, "--prefill"),
        ({"policy": "random"}, "--policy"),
        ({"decode_policy": "x"}, "--decode-policy"),
        ({"port": 70000}, "--port"),
        ({"prefix_chars": 0}, "--prefix-chars"),
        ({"connect_timeout_s": 0}, "--connect-timeout"),
        ({"read_timeout_s": -1}, "--read-timeout"),
        ({"health_interval_s": 0}, "--health-interval"),
        ({"max_connections": 0}, "--max-connections"),
        ({"first_token_from": "both"}, "--first-token-from"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ProxyConfig(**{"prefill": P, "decode": D, **kwargs})


def test_decode_policy_follows_policy_except_prefix_affinity() -> None:
    assert ProxyConfig(P, D, policy="round_robin").effective_decode_policy == "round_robin"
    assert ProxyConfig(P, D, policy="prefix_affinity").effective_decode_policy == "least_inflight"
    cfg = ProxyConfig(P, D, policy="prefix_affinity", decode_policy="round_robin")
    assert cfg.effective_decode_policy == "round_robin"
