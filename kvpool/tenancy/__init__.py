"""Tenants, a layer over the pool chosen once per connection, at its handshake: each
tenant's namespace, usage and quota (:mod:`.book`, pure), the master's handler of a
tenant's connection and of the operator's quotas (:mod:`.master`), the data port's
check of a tenant's grants (:mod:`.grants`), a tenant client's data path
(:mod:`.data_path`), and the per-tenant series on /metrics (:mod:`.metrics`).  A pool
without tenants never runs any of it."""
