from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.proxy.routing import (
    LeastInflight,
    PrefixAffinity,
    RoundRobin,
    Upstream,
    UpstreamGroup,
    make_routing_policy,
    prefix_key,
)

URLS = [f"http://127.0.0.1:{8100 + i}" for i in range(4)]


def test_round_robin_cycles_over_healthy_endpoints() -> None:
    group = UpstreamGroup("prefill", URLS[:3], RoundRobin())
    picks = [group.pick() for _ in range(6)]
    assert [p.url for p in picks if p] == URLS[:3] * 2
    group.mark_down(URLS[1], "connect refused")
    picks = [group.pick() for _ in range(4)]
    assert {p.url for p in picks if p} == {URLS[0], URLS[2]}


def test_least_inflight_prefers_the_idlest_and_rotates_ties() -> None:
    group = UpstreamGroup("decode", URLS[:3], LeastInflight())
    a, b, c = group.upstreams
    group.acquire(a)
    group.acquire(a)
    group.acquire(b)
    assert group.pick() is c
    group.acquire(c)  # now b and c tie at 1
    assert {group.pick().url, group.pick().url} == {b.url, c.url}  # type: ignore[union-attr]
    for u in (a, a, b, c):
        group.release(u)
    assert [u.inflight for u in group.upstreams] == [0, 0, 0]
    group.release(a)  # never below zero
    assert a.inflight == 0
    # all idle: consecutive picks spread instead of piling on the first endpoint
    assert len({group.pick().url for _ in range(3)}) == 3  # type: ignore[union-attr]


def test_pick_skips_excluded_and_down_endpoints_and_says_none_when_empty() -> None:
    group = UpstreamGroup("decode", URLS[:2], LeastInflight())
    assert group.pick(exclude=frozenset({URLS[0]})).url == URLS[1]  # type: ignore[union-attr]
    assert group.mark_down(URLS[1], "HTTP 500") is True
    assert group.mark_down(URLS[1], "HTTP 500") is False  # already out
    assert group.pick(exclude=frozenset({URLS[0]})) is None
    group.mark_down(URLS[0], "health failed")
    assert group.pick() is None and group.healthy() == []
    assert group.mark_up(URLS[0]) is True
    assert group.get(URLS[0]).last_error == ""
    assert group.pick().url == URLS[0]  # type: ignore[union-attr]


def test_group_refuses_no_endpoints_and_duplicates() -> None:
    with pytest.raises(ValueError, match="no prefill endpoint"):
        UpstreamGroup("prefill", [], RoundRobin())
    with pytest.raises(ValueError, match="duplicate"):
        UpstreamGroup("prefill", [URLS[0], URLS[0]], RoundRobin())


def test_make_routing_policy_names_the_choices() -> None:
    assert make_routing_policy("prefix_affinity").name == "prefix_affinity"
    with pytest.raises(ValueError, match="round_robin, least_inflight, prefix_affinity"):
        make_routing_policy("random")


def _affinity(urls: list[str], key: bytes) -> str:
    return PrefixAffinity().choose([Upstream(u) for u in urls], key).url


def test_prefix_affinity_sends_a_prefix_to_the_same_endpoint_every_time() -> None:
    system = "You are a helpful assistant. " * 20
    keys = {
        prefix_key(
            {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]},
            256,
        )
        for q in ("hi", "what is 2+2", "tell me a joke")
    }
    assert len(keys) == 1  # the user turn lies beyond the first 256 chars
    [key] = keys
    assert key is not None
    assert len({_affinity(URLS, key) for _ in range(10)}) == 1


def test_prefix_affinity_spreads_distinct_prefixes() -> None:
    counts = Counter(_affinity(URLS, f"tenant {i} system prompt".encode()) for i in range(400))
    assert set(counts) == set(URLS)
    assert min(counts.values()) > 50  # roughly 100 each


def test_losing_an_endpoint_moves_only_its_own_prefixes() -> None:
    keys = [f"prompt {i}".encode() for i in range(300)]
    before = {k: _affinity(URLS, k) for k in keys}
    survivors = [u for u in URLS if u != URLS[2]]
    after = {k: _affinity(survivors, k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == URLS[2] for k in moved)


def test_prefix_affinity_does_not_depend_on_the_process_hash_seed() -> None:
    code = (
        "import json; from kvpool.proxy.routing import PrefixAffinity, Upstream;"
        f"urls = {URLS!r};"
        "print(json.dumps([PrefixAffinity().choose([Upstream(u) for u in urls],"
        " f'p{i}'.encode()).url for i in range(50)]))"
    )
    runs = set()
    for seed in ("0", "1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        runs.add(tuple(json.loads(out)))
    assert len(runs) == 1
    assert list(next(iter(runs))) == [_affinity(URLS, f"p{i}".encode()) for i in range(50)]


def test_prefix_affinity_without_a_key_falls_back_to_least_inflight() -> None:
    ups = [Upstream(u) for u in URLS[:2]]
    ups[0].inflight = 3
    assert PrefixAffinity().choose(ups, None) is ups[1]


def test_prefix_key_of_each_prompt_shape() -> None:
    assert prefix_key({"prompt": "abcdef"}, 3) == b"abc"
    assert prefix_key({"prompt": ["abcdef", "zzz"]}, 4) == b"abcd"
    assert prefix_key({"prompt": [1, 2, 3, 4]}, 2) == b"1,2"
    assert prefix_key({"prompt": [[5, 6, 7], [8]]}, 2) == b"5,6"
    assert prefix_key({"prompt": ""}, 3) is None
    assert prefix_key({"model": "m"}, 3) is None
    chat = {"messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}]}
    assert prefix_key(chat, 100) == b"system\x1fbe brief\x1e"
    # the same text as a plain string or as a text part is the same prefix
    plain = {"messages": [{"role": "system", "content": "be brief"}]}
    assert prefix_key(plain, 100) == prefix_key(chat, 100)


@given(st.text(min_size=64), st.text(), st.integers(min_value=1, max_value=64))
def test_prefix_key_ignores_everything_past_n_chars(head: str, tail: str, n: int) -> None:
    a = prefix_key({"prompt": head[:n] + tail}, n)
    b = prefix_key({"prompt": head[:n]}, n)
    assert a == b
