"""The pure core of kvpool: no I/O, no clock (time is a parameter), no logging, no threads.
Effects (evictions, demotions, drops) are returned as values for the service to carry out.
The words (block, chunk, object, page, segment, tier) are defined in :mod:`kvpool`'s glossary.
"""
