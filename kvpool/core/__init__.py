"""The pure core of kvpool: no I/O, no clock (time is a parameter), no logging, no threads.
Effects (evictions, demotions, drops) are returned as values for the service to carry out.

Modules, from the bottom up:
    keys          chained content keys of token chunks (BlockKey, KeyNamespace, chunk_keys)
    space         extent allocation inside one segment (ExtentAllocator, Extent)
    registry      clients, their heartbeats and the segments they contribute, per tier
    eviction      the eviction-policy protocol, LRU, and policies by name
                  (make_eviction_policy; "default" is an alias of "prefix_aware")
    prefix_aware  kvpool's default eviction policy for prefix-chained blocks, and why
    objects       the values the index works with: config, records, locations, grants,
                  effects (Demote, Dropped), counters
    placement     where an object goes: allocation, inline eviction, demotion, watermark
                  rounds (IndexPlacement, the lowest base class of ObjectIndex)
    leases        reads and holds: probes, read leases, pins, their release and expiry
                  (IndexLeases, the base class of ObjectIndex)
    index         the object index: its life cycle (two-phase puts, restore, removals,
                  ticks) and invariants

The words (block, chunk, object, page, segment, tier) are defined once, in the glossary of
:mod:`kvpool`'s docstring.
"""
