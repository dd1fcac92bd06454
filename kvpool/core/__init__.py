"""The pure core of kvpool: no I/O, no clock (time is a parameter), no logging, no threads.

Modules:
    keys      chained content keys of token chunks (BlockKey, KeyNamespace)
    space     extent allocation inside a segment
    registry  clients and the segments they contribute
    eviction  eviction policies (LRU baseline, kvpool's prefix-aware default)
    objects   the values the index works with: config, locations, grants, events
    index     the object index: two-phase puts, leases, pins, tiers, eviction, clients
"""
