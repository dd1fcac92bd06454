"""Storage a process contributes to the pool (its segment, SSD tier and data server),
``kvpool node``, and the catalog changes owed to nodes with their heartbeats.
"""
