"""Everything kvpool does with real Mooncake, one module per concept.

This package plugs into the parts it serves (:mod:`kvpool.named`), never the reverse; the
``mooncake`` wheel, an optional extra, is imported only inside these modules, when used.
"""
