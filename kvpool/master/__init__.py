"""``kvpool master``: the request handler over the index (:mod:`.service`), its storage
owners (:mod:`.clients`), nodes' copies in flight (:mod:`.copies`, :mod:`.node_copies`,
:mod:`.node_links`), and the asyncio server with its HTTP side (:mod:`.server`,
:mod:`.http`, :mod:`.metrics`, :mod:`.snapshot`, :mod:`.status_page`).  The connection
handshake is :mod:`kvpool.security.master_handshake`; tenants are a layer over the
master, :mod:`kvpool.tenancy`, which the server picks for a tenant's connection."""
