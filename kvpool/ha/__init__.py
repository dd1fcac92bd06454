"""Highly available masters: leader election on etcd, and clients that follow the leader."""
