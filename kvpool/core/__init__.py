"""The pure core of kvpool: no I/O, no clock (time is a parameter), no logging, no threads.

Modules:
    keys      chained content keys of token chunks (BlockKey, KeyNamespace)
    space     extent allocation inside a segment
    eviction  eviction policies (LRU baseline, kvpool's prefix-aware default)
    index     the object index: two-phase puts, leases, pins, tiers, eviction, clients
"""
