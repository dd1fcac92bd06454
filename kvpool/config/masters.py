"""Where a client finds its master: one address, a list of masters, or etcd (pure).

``master_server_address`` (and ``metadata_server``, and every ``--master`` flag) takes
``host:port``; ``host:port,host:port...`` (HA masters: any of them says which leads); or
``etcd://host:port[,host:port...][/cluster_id]`` (Mooncake's spelling; ``cluster_id`` is
the masters' ``--cluster_id``, ``kvpool`` by default).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.config.values import parse_host_port
from kvpool.errors import ConfigError

__all__ = ["ETCD_SCHEME", "Masters", "parse_address_list", "parse_masters"]

ETCD_SCHEME = "etcd://"


@dataclass(frozen=True, slots=True)
class Masters:
    addresses: tuple[str, ...] = ()  # masters to ask (none with etcd)
    etcd: tuple[str, ...] = ()  # etcd endpoints, host:port
    cluster_id: str = "kvpool"

    @property
    def ha(self) -> bool:
        """More than one master could lead: the client must find (and follow) the leader."""
        return len(self.addresses) > 1 or bool(self.etcd)

    @property
    def first(self) -> str:
        """The address a single-master client dials (and messages name)."""
        return self.addresses[0] if self.addresses else self.etcd[0]

    def __str__(self) -> str:
        if self.etcd:
            return f"{ETCD_SCHEME}{','.join(self.etcd)}/{self.cluster_id}"
        return ",".join(self.addresses)


def parse_address_list(text: str, key: str, example: str) -> tuple[str, ...]:
    """``host:port,host:port...`` as a tuple, IPv6 hosts bracketed (ConfigError naming
    ``key``, with ``example``, on a malformed or empty one)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            host, port = parse_host_port(part, key=key)
        except ConfigError:
            raise ConfigError(f"{key}: {part!r} is not host:port (e.g. {example})") from None
        out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if not out:
        raise ConfigError(f"{key}: empty; expected host:port such as {example}")
    return tuple(out)


def parse_masters(text: str, *, key: str) -> Masters:
    """Read a master address as above; a malformed one names ``key`` and the forms."""
    text = text.strip()
    if text.startswith(ETCD_SCHEME):
        rest = text[len(ETCD_SCHEME) :]
        hosts, _, cluster = rest.partition("/")
        cluster = cluster.strip("/") or "kvpool"
        if "/" in cluster:
            raise ConfigError(f"{key}: {text!r}: the cluster id after the hosts has no '/'")
        etcd = parse_address_list(hosts, key, "etcd://10.0.0.5:2379")
        return Masters(etcd=etcd, cluster_id=cluster)
    if "://" in text:
        raise ConfigError(
            f"{key}: {text!r}: the only scheme is etcd:// (etcd://host:2379[/cluster_id]); "
            "masters are host:port[,host:port...]"
        )
    return Masters(addresses=parse_address_list(text, key, "10.0.0.1:50051,10.0.0.2:50051"))
