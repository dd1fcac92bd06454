"""Tenants, a layer over the pool chosen once per connection, at its handshake: each
tenant's namespace, usage and quota, its grants on the data port, and its series on
/metrics.  A pool without tenants never runs any of it.
"""
