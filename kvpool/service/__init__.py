"""Thin services over the core: the master, storage nodes, and the client.

The master:

- :mod:`kvpool.service.master` -- its request handler (the one place where requests meet
  the index and errors become replies); :mod:`~kvpool.service.master_clients` its
  storage owners (registration, segments, heartbeats, re-announcements);
  :mod:`~kvpool.service.master_tenants` tenancy, a layer over it for tenants' connections.
- :mod:`kvpool.service.master_server` -- ``kvpool master``: the asyncio server, one port
  for the binary RPC and for HTTP; :mod:`~kvpool.service.http` and
  :mod:`~kvpool.service.status_page` are its HTTP side, :mod:`~kvpool.service.metrics`
  its Prometheus metrics, :mod:`~kvpool.service.snapshot` the pool at a glance.
- :mod:`kvpool.service.catalog` -- catalog changes owed to nodes with their heartbeats;
  :mod:`kvpool.service.node_links` -- the master's connections to nodes, one thread each;
  :mod:`kvpool.service.copies` and :mod:`~kvpool.service.master_copies` -- nodes' copies
  in flight and the replies held for them or for a node's catalog, off the event loop.

Storage and nodes:

- :mod:`kvpool.service.local_storage` -- the storage a process contributes (segment, SSD
  tier, data server), in a master or a node.
- :mod:`kvpool.service.node` -- ``kvpool node``: registration, heartbeats, catalog.

Clients (public as ``kvpool.Client``, ``kvpool.AsyncClient``, ``kvpool.EmbeddedPool``):

- :mod:`kvpool.service.client` -- the synchronous client, over a transport
  (:mod:`kvpool.transfer.transport`) and a link to the master
  (:mod:`kvpool.service.master_link`).
- :mod:`kvpool.service.async_client` -- its asyncio twin.
- :mod:`kvpool.service.embedded` -- a whole pool in this process.
"""
