"""Thin services over the core: the master, storage nodes, and the client."""
