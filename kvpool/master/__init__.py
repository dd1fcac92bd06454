"""``kvpool master``: the request handler over the index, its storage owners, the nodes'
copies in flight, and the asyncio server with its HTTP side.  Tenants are a layer over the
master (:mod:`kvpool.tenancy`), picked by the server for a tenant's connection.
"""
