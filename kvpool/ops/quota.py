"""``kvpool quota``: set a tenant's byte quota on a running master, and show every tenant's
(``set`` over the RPC port with the cluster secret, ``show`` from ``/metrics``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

from kvpool.config.values import format_size, parse_size
from kvpool.errors import ConfigError, KVPoolError
from kvpool.net import master_scheme
from kvpool.ops.status import _get, _samples, default_master
from kvpool.protocol import messages as m
from kvpool.security.credentials import check_tenant_name
from kvpool.security.secret import ENV_SECRET_FILE, load_credential, operator_headers

__all__ = ["QuotaOptions", "TenantUsage", "parse_tenants", "run"]

ACTIONS = ("set", "show")
_SERIES = {
    "kvpool_tenant_quota_bytes": "quota_bytes",
    "kvpool_tenant_bytes": "bytes",
    "kvpool_tenant_objects": "objects",
    "kvpool_tenant_hits_total": "hits",
    "kvpool_tenant_misses_total": "misses",
    "kvpool_tenant_evictions_total": "evictions",
    "kvpool_tenant_quota_refusals_total": "refused",
}


@dataclass(frozen=True, slots=True)
class QuotaOptions:
    action: str
    tenant: str = ""
    size: str = ""  # set: 8GB, 512MiB, 0 (no quota)
    master: str | None = None
    secret_file: str = ""
    as_json: bool = False


@dataclass(frozen=True, slots=True)
class TenantUsage:
    tenant: str
    quota_bytes: int = 0
    bytes: int = 0
    objects: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0


def parse_tenants(metrics_text: str) -> list[TenantUsage]:
    """Every tenant's row from the master's ``kvpool_tenant_*`` series."""
    rows: dict[str, dict[str, int]] = {}
    for name, labels, value in _samples(metrics_text):
        field = _SERIES.get(name)
        if field is not None and "tenant" in labels:
            rows.setdefault(labels["tenant"], {})[field] = int(value)
    return [TenantUsage(tenant, **fields) for tenant, fields in sorted(rows.items())]


def run(options: QuotaOptions, *, out: TextIO | None = None) -> int:
    """Exit status 0, or 1 with one line on stderr when the master refuses or is not there."""
    stream = out or sys.stdout
    master = options.master or default_master(os.environ)
    try:
        if options.action == "set":
            _set(options, master, stream)
        else:
            _show(options, master, stream)
    except ConfigError:
        raise  # the CLI's usage error: exit status 2
    except KVPoolError as exc:
        print(f"kvpool quota {options.action}: {master}: {exc}", file=sys.stderr)
        return 1
    return 0


def _set(options: QuotaOptions, master: str, stream: TextIO) -> None:
    from kvpool.client.client import Client

    if not options.tenant or not options.size:
        raise ConfigError("name the tenant and the size: kvpool quota set TENANT SIZE (e.g. 8GB)")
    check_tenant_name(options.tenant, "TENANT")
    quota = parse_size(options.size, key="SIZE")
    credential = load_credential(options.secret_file, os.environ, key="--secret-file")
    if credential is None or not credential.is_cluster:
        raise ConfigError(
            f"--secret-file: a quota is the operator's: name the cluster secret's file "
            f"(or set {ENV_SECRET_FILE})"
        )
    with Client(master, credential=credential, timeout_s=10) as client:
        reply = client.call(m.SetQuota(options.tenant, quota))
    held = reply.value if isinstance(reply, m.Count) else 0
    shown = format_size(quota) if quota else "none"
    if options.as_json:
        row = {"tenant": options.tenant, "quota_bytes": quota, "bytes": held}
        print(json.dumps(row), file=stream)
    else:
        print(f"tenant {options.tenant}: quota {shown}, holds {format_size(held)}", file=stream)


def _show(options: QuotaOptions, master: str, stream: TextIO) -> None:
    env = dict(os.environ)
    if options.secret_file:
        env[ENV_SECRET_FILE] = options.secret_file
    url = f"{master_scheme()}://{master}/metrics"
    text = _get(url, 5.0, operator_headers(env)).decode("utf-8", "replace")
    rows = parse_tenants(text)
    if options.tenant:
        rows = [r for r in rows if r.tenant == options.tenant]
    if options.as_json:
        for r in rows:
            print(json.dumps(_row(r)), file=stream)
        return
    if not rows:
        print("no tenants (set one: kvpool quota set TENANT SIZE)", file=stream)
        return
    head = ("tenant", "quota", "holds", "objects", "hits", "misses", "evicted", "refused")
    table = [head] + [
        (
            r.tenant,
            format_size(r.quota_bytes) if r.quota_bytes else "none",
            format_size(r.bytes),
            *(str(v) for v in (r.objects, r.hits, r.misses, r.evictions, r.refused)),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip(), file=stream)


def _row(r: TenantUsage) -> Mapping[str, object]:
    return {f: getattr(r, f) for f in TenantUsage.__dataclass_fields__}
