"""Everything kvpool does with real Mooncake, one module per concept.

:mod:`.engine` (the ``mooncake`` pool engine), :mod:`.mover` and :mod:`.transport` (the
Transfer Engine, and on it the P→D transport), :mod:`.master`, :mod:`.wheel`, and the
pure :mod:`.doctor`, :mod:`.render` and :mod:`.up`.  This package plugs into the parts it
serves (:mod:`kvpool.named`); the ``mooncake`` wheel, an optional extra, is imported only
inside these modules, when used.
"""
