"""Where a process finds its credential, and when it may run without one.

A file named by the command or the node config, then ``KVPOOL_SECRET_FILE``, then
``KVPOOL_SECRET``; a server bound beyond loopback without one refuses to start.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Mapping

from kvpool.errors import ConfigError
from kvpool.security.credentials import Credential

__all__ = [
    "ENV_INSECURE",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "connector_credential",
    "is_loopback",
    "load_credential",
    "operator_headers",
    "read_secret_file",
    "require_credential",
    "require_private_file",
]

ENV_SECRET_FILE = "KVPOOL_SECRET_FILE"
ENV_SECRET = "KVPOOL_SECRET"
#: a connector's "insecure": true from the environment (kvpool.config.kv_transfer, which
#: names it too: security reads no config; tests/security/test_package.py holds both equal)
ENV_INSECURE = "KVPOOL_INSECURE"


# A file holds the cluster secret, or one node's credential
# (:meth:`kvpool.security.credentials.Credential.parse`); while a secret is rotated, two lines:
# the new one, then the previous one, both accepted from peers (docs/security.md, "Rolling
# rotation").  A secret file readable or writable
# by every user is refused (``chmod 600 PATH``): a secret anyone on the host can read
# protects nothing.  A secret that is too short or repetitive is refused.
def read_secret_file(path: str, key: str) -> Credential:
    """The credential in the file at ``path``; ``key`` names the setting that chose it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot read the secret file {path} ({exc.strerror}); create it with "
            f"`openssl rand -hex 32 > {path} && chmod 600 {path}`"
        ) from None
    require_private_file(path, mode, key, "secret file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read the secret file {path} ({exc})") from None
    return Credential.parse(text, f"{key} ({path})")


def require_private_file(path: str, mode: int, source: str, what: str) -> None:
    """ConfigError unless the file at ``path`` (its ``st_mode``: ``mode``) is a regular
    file that not every user of the host may read or write; ``source`` names the setting
    that chose it, ``what`` says what it should hold ("secret file", "key file")."""
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{source}: {path} is not a regular file; name the {what}")
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(
            f"{source}: {path} is readable or writable by every user of this host; "
            f"run `chmod 600 {path}`"
        )


# Sources, first found wins:
#
# 1. a file named by the command (``kvpool master --secret_file PATH``) or the node config
#    (``"secret_file"`` in mooncake.json);
# 2. ``KVPOOL_SECRET_FILE``, a file;
# 3. ``KVPOOL_SECRET``, the secret itself (for containers; a file is better: the
#    environment of a process is readable by its user's other processes).
def load_credential(secret_file: str, env: Mapping[str, str], *, key: str) -> Credential | None:
    """The credential from ``secret_file`` (named by setting ``key``), else the
    environment; None when none is configured anywhere."""
    if secret_file:
        return read_secret_file(secret_file, key)
    if env.get(ENV_SECRET_FILE):
        return read_secret_file(env[ENV_SECRET_FILE], ENV_SECRET_FILE)
    if env.get(ENV_SECRET):
        return Credential.parse(env[ENV_SECRET], ENV_SECRET)
    return None


def connector_credential(secret_file: str, env: Mapping[str, str]) -> Credential | None:
    """The credential of a connector's connections, found as every kvpool process finds
    its own: the node config's ``secret_file``, else ``KVPOOL_SECRET_FILE``, else
    ``KVPOOL_SECRET``; None when none is configured.  Both connectors use it (the
    transfer connector's ``kv_port``; the store connector's pool handle)."""
    return load_credential(secret_file, env, key="secret_file")


def operator_headers(env: Mapping[str, str]) -> dict[str, str]:
    """The HTTP headers of an operator holding the environment's cluster secret (none
    without one): what ``kvpool status`` and ``kvpool doctor`` send to the master."""
    credential = load_credential("", env, key="secret_file")
    if credential is None or not credential.is_cluster:
        return {}
    return {"Authorization": f"Bearer {credential.operator_token()}"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches only this machine (a name other than ``localhost`` counts
    as reachable: it may resolve to any interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Safe by default (:func:`require_credential`): a server bound to an address other than
# loopback without a credential refuses to start, unless told ``--insecure``; on loopback
# nothing changes, so ``kvpool up`` and a one-host pool need no setup.
def require_credential(
    host: str, credential: Credential | None, insecure: bool, *, key: str
) -> None:
    """Refuse to serve ``host`` beyond loopback without a credential (``key`` names the
    bind setting), unless ``insecure``."""
    if credential is not None or insecure or is_loopback(host):
        return
    raise ConfigError(
        f"{key} {host}: a pool reachable from other hosts without a credential is open to "
        f"anyone who can reach it; set --secret_file (or {ENV_SECRET_FILE}) to the cluster "
        "secret, or pass --insecure to run it open"
    )
