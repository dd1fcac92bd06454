"""The kv_aware policy: where a prompt's prefill costs least."""

from __future__ import annotations

from kvpool.protocol.kv_events import BlockStored
from kvpool.proxy.block_index import BlockIndex, content_keys
from kvpool.proxy.routing import KvAware, LeastLoaded, Prompt, Upstream

BS = 4
TOKENS = list(range(40))  # ten blocks
KEYS = tuple(content_keys(TOKENS, BS))
PROMPT = Prompt(KEYS, len(TOKENS))


def holding(n_blocks: int, medium: str = "GPU") -> BlockIndex:
    index = BlockIndex()
    if n_blocks:
        hashes = [f"h{i}".encode() for i in range(n_blocks)]
        index.apply(
            [
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=TOKENS[: n_blocks * BS],
                    block_size=BS,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
            ]
        )
    return index


def upstreams(*held: int) -> list[Upstream]:
    return [Upstream(f"http://p{i}", blocks=holding(n)) for i, n in enumerate(held)]


def test_the_instance_holding_the_longest_prefix_wins() -> None:
    policy = KvAware()
    ups = upstreams(2, 8, 0)
    assert policy.choose(ups, None, PROMPT).url == "http://p1"
    assert policy.predicted["http://p1"] == (8, 0)


def test_the_pool_makes_every_instance_a_near_hit() -> None:
    pool = holding(10, medium="CPU")
    policy = KvAware(pool)
    ups = upstreams(0, 0)
    ups[0].inflight = 1  # busier: with the pool's hit either will do, so load decides
    assert policy.choose(ups, None, PROMPT).url == "http://p1"
    assert policy.predicted["http://p1"] == (0, 10)
    # its own cache still beats loading from the pool
    ups = upstreams(0, 10)
    assert policy.choose(ups, None, PROMPT).url == "http://p1"


def test_load_outweighs_a_small_hit() -> None:
    policy = KvAware()
    ups = upstreams(1, 0)
    ups[0].waiting = 6  # six requests queued there
    assert policy.choose(ups, None, PROMPT).url == "http://p1"


def test_an_instance_whose_events_are_not_trusted_holds_nothing() -> None:
    policy = KvAware()
    ups = upstreams(10, 0)
    ups[0].trusted = False
    ups[0].inflight = 1
    assert policy.choose(ups, None, PROMPT).url == "http://p1"


def test_without_a_prompt_or_events_it_routes_by_load() -> None:
    policy = KvAware()
    ups = [Upstream("http://a", waiting=3), Upstream("http://b", waiting=0)]
    assert policy.choose(ups, None, PROMPT).url == "http://b"  # nobody's events
    ups = upstreams(10, 0)
    ups[0].waiting = 1
    assert policy.choose(ups, None, None).url == "http://p1"  # no prompt


def test_least_loaded_counts_the_queue_then_kv_usage() -> None:
    policy = LeastLoaded()
    ups = [
        Upstream("http://a", inflight=1, kv_usage=0.1),
        Upstream("http://b", waiting=1, kv_usage=0.5),
        Upstream("http://c", inflight=2),
    ]
    assert policy.choose(ups, None).url == "http://a"


def test_what_an_instance_was_just_sent_counts_as_held_until_its_events_come() -> None:
    """A tenant's second request, sent before its first one's blocks are in the first
    instance's events, still goes there (for pending_s)."""
    policy = KvAware(pending_s=10)
    ups = upstreams(0, 0)
    first = policy.choose(ups, None, Prompt(KEYS, len(TOKENS), now=0.0))
    first.inflight = 1  # still computing it: a blind policy would go elsewhere now
    assert policy.choose(ups, None, Prompt(KEYS, len(TOKENS), now=1.0)) is first
    # long after, with nothing in its events, it holds nothing: load decides
    assert policy.choose(ups, None, Prompt(KEYS, len(TOKENS), now=30.0)) is not first
