"""The pure core of kvpool: no I/O, no clock (time is a parameter), no logging, no threads.
Effects (evictions, demotions, drops) are returned as values for the service to carry out.

Modules, from the bottom up:
    keys          chained content keys of token chunks (BlockKey, KeyNamespace, chunk_keys)
    space         extent allocation inside one segment (ExtentAllocator, Extent)
    registry      clients, their heartbeats and the segments they contribute, per tier
    eviction      the eviction-policy protocol, LRU, and policies by name
                  (make_eviction_policy; "default" is an alias of "prefix_aware")
    prefix_aware  kvpool's default eviction policy for prefix-chained blocks, and why
    queue_policy  what the queue policies share: nodes, runs, orphans, the prefix rule
    s3fifo, arc   S3-FIFO and ARC, as published and on the prefix tree
    objects       the values the index works with: config, records, locations, grants,
                  effects (Demote, Dropped), counters
    placement     each tier's segments, the room in them and the room copies in flight
                  will free (Placement, owned by the index)
    leases        read leases and pins: their owners, expiry and counts (Holds, owned by
                  the index)
    index         the object index (ObjectIndex): its life cycle (two-phase puts, reads,
                  restore, removals, eviction, demotion, ticks) and invariants

The words (block, chunk, object, page, segment, tier) are defined once, in the glossary of
:mod:`kvpool`'s docstring.
"""
