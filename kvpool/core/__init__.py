"""The pure core of kvpool: no I/O, no clock (time is a parameter), no logging, no threads.
Effects (evictions, demotions, drops) are returned as values for the service to carry out.

Modules, from the bottom up: keys (chained content keys), space (extents in a segment),
registry (clients, heartbeats, segments), the eviction policies (eviction, prefix_aware,
queue_policy, s3fifo, arc), objects (the index's values and effects), placement, leases,
replicas and demotion (owned by the index), and index (:class:`ObjectIndex`).  The words
(block, chunk, object, page, segment, tier) are defined once, in the glossary of
:mod:`kvpool`'s docstring.
"""
