"""``kvpool secret``: make a cluster secret, and what operators and nodes derive from it.

- ``kvpool secret new`` prints a fresh secret (256 random bits, hex) to put in a file
  with mode 600 (``KVPOOL_SECRET_FILE``, ``--secret_file``, the node config's
  ``secret_file``).
- ``kvpool secret token`` prints the bearer token of the master's HTTP endpoints
  (``curl -H "Authorization: Bearer $(kvpool secret token)" http://MASTER/api/status``).
- ``kvpool secret node-key --node-id ID`` prints node ID's credential: a node given only
  that can be node ID and nothing else (docs/security.md).
- ``kvpool secret tenant-key --tenant NAME`` prints tenant NAME's credential: a client
  given only that works in tenant NAME's namespace and nothing else (docs/security.md,
  "Tenants and quotas").

The secret is read as every kvpool process reads it: ``--secret-file``, else
``KVPOOL_SECRET_FILE``, else ``KVPOOL_SECRET``.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass

from kvpool.config.secret import ENV_SECRET_FILE, load_credential
from kvpool.errors import ConfigError, KVPoolError

__all__ = ["SecretOptions", "run"]

ACTIONS = ("new", "token", "node-key", "tenant-key")


@dataclass(frozen=True, slots=True)
class SecretOptions:
    action: str
    secret_file: str = ""
    node_id: str = ""
    tenant: str = ""


def run(opts: SecretOptions) -> int:
    if opts.action == "new":
        print(secrets.token_hex(32))
        return 0
    credential = load_credential(opts.secret_file, os.environ, key="--secret-file")
    if credential is None:
        raise ConfigError(
            f"--secret-file: no secret configured; name the file (or set {ENV_SECRET_FILE})"
        )
    try:
        if opts.action == "token":
            print(credential.operator_token())
        elif opts.action == "tenant-key":
            if not opts.tenant:
                raise ConfigError("--tenant: name it (kvpool secret tenant-key --tenant NAME)")
            if not credential.is_cluster:
                raise ConfigError("--secret-file: a tenant key derives from the cluster secret")
            print(credential.tenant_credential(opts.tenant))
        else:
            if not opts.node_id.startswith("node-"):
                raise ConfigError("--node-id: a node id starts with node- (node-<name>)")
            print(credential.node_credential(opts.node_id))
    except KVPoolError as exc:  # ConfigError included: one line, exit 1
        print(f"kvpool secret {opts.action}: {exc}", file=sys.stderr)
        return 1
    return 0
