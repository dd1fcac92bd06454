"""The pool's clients (public as ``kvpool.Client`` and ``kvpool.AsyncClient``): the
synchronous client over a data path and a link to the master (:mod:`.client`,
:mod:`.master_link`), and its asyncio twin (:mod:`.async_client`)."""
