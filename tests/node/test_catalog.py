"""The outbox of catalog changes: what a node ends up holding after applying each reply
(its adds, then its removals) is what the master holds, however puts and removals of a
key interleave between two heartbeats."""

from __future__ import annotations

import random

from kvpool.node.catalog import CatalogEntry, Outbox

NODE = "node-a"


def entry(key: str, offset: int) -> CatalogEntry:
    return (key, f"{NODE}/mem", offset, 10, offset + 1)


def apply(catalog: dict[str, CatalogEntry], outbox: Outbox) -> None:
    """As NodeService.heartbeat_once applies a reply: adds first, then removals."""
    changes = outbox.take(NODE)
    for e in changes.added:
        catalog[e[0]] = e
    for key in changes.removed:
        catalog.pop(key, None)


def test_a_key_removed_and_put_again_between_heartbeats_stays_in_the_catalog() -> None:
    outbox = Outbox()
    outbox.watch(NODE)
    catalog: dict[str, CatalogEntry] = {}
    outbox.add(NODE, entry("k", 0))
    apply(catalog, outbox)
    outbox.remove(NODE, "k")  # evicted ...
    outbox.add(NODE, entry("k", 100))  # ... and put again, elsewhere, before the reply
    apply(catalog, outbox)
    assert catalog == {"k": entry("k", 100)}
    outbox.add(NODE, entry("j", 200))
    outbox.remove(NODE, "j")  # put and evicted before the node heard of it
    changes = outbox.take(NODE)
    assert changes.added == [] and changes.removed == ["j"]


def test_any_interleaving_leaves_the_node_holding_what_the_master_holds() -> None:
    rng = random.Random(7)
    for _ in range(200):
        outbox = Outbox()
        outbox.watch(NODE)
        truth: dict[str, CatalogEntry] = {}
        catalog: dict[str, CatalogEntry] = {}
        for step in range(60):
            key = rng.choice("abcd")
            if key in truth and rng.random() < 0.5:
                del truth[key]
                outbox.remove(NODE, key)
            elif key not in truth:
                truth[key] = entry(key, step)
                outbox.add(NODE, truth[key])
            if rng.random() < 0.2:
                apply(catalog, outbox)
        apply(catalog, outbox)
        assert catalog == truth


def test_adds_are_counted_for_confirmation_even_when_a_removal_voids_them() -> None:
    outbox = Outbox()
    outbox.watch(NODE)
    outbox.add(NODE, entry("k", 0))
    outbox.remove(NODE, "k")
    assert outbox.seq(NODE) == 1 and outbox.confirmed(NODE) == 0
    outbox.take(NODE)
    outbox.confirm(NODE)  # the node heartbeat again: a put waiting on seq 1 is answered
    assert outbox.confirmed(NODE) >= 1
