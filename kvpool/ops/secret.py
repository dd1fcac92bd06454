"""``kvpool secret``: make a cluster secret, and the token and keys derived from it
(docs/security.md says what each may do).
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass

from kvpool.errors import ConfigError, KVPoolError
from kvpool.security.secret import ENV_SECRET_FILE, load_credential

__all__ = ["SecretOptions", "run"]

ACTIONS = ("new", "token", "node-key", "tenant-key")


@dataclass(frozen=True, slots=True)
class SecretOptions:
    action: str
    secret_file: str = ""
    node_id: str = ""
    tenant: str = ""


# The secret is read as every kvpool process reads it: ``--secret-file``, else
# ``KVPOOL_SECRET_FILE``, else ``KVPOOL_SECRET``.
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
