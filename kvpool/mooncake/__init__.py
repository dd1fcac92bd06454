"""Everything kvpool does with real Mooncake, one module per concept.

:mod:`.engine` (the ``mooncake`` pool engine; its object layout :mod:`.parts` over the
memory of :mod:`.buffers`), :mod:`.mover` and :mod:`.transport` (the Transfer Engine, and
on it the P→D transport), :mod:`.master` (a running ``mooncake_master`` read),
:mod:`.wheel` (the installed wheel, found), and the pure :mod:`.doctor`, :mod:`.render`
and :mod:`.up`.  This package plugs into the parts it
serves: the engine factory and the transfer connector name its modules
(:mod:`kvpool.named`), ops imports it.  The ``mooncake`` wheel, an optional extra, is
imported only inside these modules, when used.
"""
