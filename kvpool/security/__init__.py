"""Who may speak to the pool: credentials, the handshake that proves them, TLS, secrets.

Without I/O: :mod:`.credentials` (the cluster secret, the keys derived from it, grants),
:mod:`.handshake` (the frames and both sides as state machines), :mod:`.admission` (a
server's side fed bytes).  Over sockets: :mod:`.socket_auth` (blocking), :mod:`.kv_port`
(the prefill's ``kv_port``), :mod:`.master_handshake` (the master's event loop).
:mod:`.secret` finds a process's credential; :mod:`.tls` turns TLS settings into ``ssl``
contexts, :mod:`.socket_tls` wraps blocking sockets with them, :mod:`.peer` hands both to
each link and data port.  Nothing is imported here: one module never imports the others.
"""
