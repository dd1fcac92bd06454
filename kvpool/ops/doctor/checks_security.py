"""Doctor's checks of the pool's credentials on kvpool's engine (pure: facts in, checks out);
on Mooncake, :func:`kvpool.mooncake.doctor.security_finding` speaks instead.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

from kvpool.config import MasterConfig, NodeConfig
from kvpool.ops.doctor.checks import Check, fail, pass_, skip, warn
from kvpool.security.secret import ENV_SECRET_FILE, is_loopback

__all__ = [
    "MasterAuthFacts",
    "SecretFileFacts",
    "check_master_auth",
    "check_master_bind",
    "check_node_bind",
    "check_secret_file",
]

_NEW = "kvpool config render writes one (or `kvpool secret new > {p} && chmod 600 {p}`)"
#: what an operator does about an open pool
OPEN_FIX = (
    "give the master --secret_file (kvpool config render writes the secret and every host's"
    " credential) and drop --insecure; until then keep every pool port on a private network"
)


@dataclass(frozen=True, slots=True)
class SecretFileFacts:
    """One secret file a process on this host would read."""

    source: str  # the setting that names it: "secret_file", KVPOOL_SECRET_FILE, --secret_file
    path: str
    mode: int | None  # its permission bits; None when it cannot be stat'ed
    error: str | None = None  # the loader's refusal (kvpool.security.secret), verbatim
    holds: str = ""  # "the cluster secret" or "node node-x's credential"


@dataclass(frozen=True, slots=True)
class MasterAuthFacts:
    """The handshake with the master, run with this host's credential."""

    address: str
    role: str  # what this host proved as: client (cluster secret) or node (its node key)
    error: str | None = None  # the AuthError / timeout text; None: the master accepted
    #: no credential here: whether the master turned away a request without one
    required: bool | None = None


# - ``security.secret_file[<source>]``: each secret file this host's processes would read
#   (the node config's ``secret_file``, ``KVPOOL_SECRET_FILE``, the master's
#   ``--secret_file`` when the master runs here) exists, is readable by its owner only
#   (600 or 400), and holds a valid secret or node credential — what
#   :mod:`kvpool.security.secret` would refuse at start-up is a FAIL here first;
def check_secret_file(facts: SecretFileFacts) -> Check:
    name = f"security.secret_file[{facts.source}]"
    p = facts.path
    if facts.mode is None:
        return fail(name, f"{facts.source} names {p}, which does not exist here", _NEW.format(p=p))
    if facts.mode & (stat.S_IROTH | stat.S_IWOTH):
        return fail(
            name,
            f"{p} (mode {facts.mode:03o}) is readable or writable by every user: kvpool refuses it",
            f"chmod 600 {p}",
        )
    if facts.error is not None:
        return fail(name, facts.error, _NEW.format(p=p))
    if facts.mode & stat.S_IRWXG:
        return warn(
            name,
            f"{p} holds {facts.holds} but its mode is {facts.mode:03o}: its group can read it",
            f"chmod 600 {p} (the owner alone: 600 or 400)",
        )
    return pass_(name, f"{p} holds {facts.holds}, mode {facts.mode:03o}")


# - ``security.master_auth``: the master accepts this host's credential (the handshake of
#   :mod:`kvpool.security.socket_auth`, run by the gatherer), or says why not: different secrets,
#   a master without one, a host without one;
def check_master_auth(facts: MasterAuthFacts | None) -> Check | None:
    """None when neither the master nor this host has a secret (a loopback pool; the
    bind checks speak for one beyond loopback)."""
    name = "security.master_auth"
    if facts is None:
        return skip(name, "no kvpool master answered to run the handshake with")
    where = f"the master at {facts.address}"
    if facts.required is not None:  # no credential on this host
        if facts.required:
            return fail(
                name,
                f"{where} requires a credential and this host has none: every client and"
                " node here is refused",
                f'set {ENV_SECRET_FILE} (P/D hosts) or "secret_file" in the node config to the'
                " file kvpool config render wrote for this host",
            )
        return None
    if facts.error is None:
        return pass_(name, f"{where} accepted this host's credential as {facts.role}")
    text = facts.error
    if "different secrets" in text or "wrong credential" in text:
        return fail(
            name,
            f"{where} holds a different secret from this host's: {text}",
            "copy the cluster's current secret (the rendered `secret`) to this host, or this"
            " host's node.cred rendered from it, and restart its processes",
        )
    if "does not speak the handshake" in text or "does it hold a secret" in text:
        return fail(
            name,
            f"{where} runs without a secret, but this host has one: {text}",
            "start the master with --secret_file (the rendered master.sh does)",
        )
    return fail(name, f"the handshake with {where} failed: {text}", "see the message")


# - ``security.node_bind`` / ``security.master_bind``: a node or master bound beyond
#   loopback without a credential refuses to start (FAIL, with the fix); a master told
#   ``--insecure`` serves an open pool (WARN).
def check_node_bind(node: NodeConfig | None, has_credential: bool) -> Check | None:
    """A node beyond loopback needs a credential (kvpool node refuses to start without)."""
    if node is None:
        return None
    name = "security.node_bind"
    host = node.local_hostname
    if is_loopback(host):
        return pass_(name, f"the node serves {host}: reachable from this host only")
    if has_credential:
        return pass_(name, f"the node serves {host} with a credential")
    return fail(
        name,
        f"the node serves {host}, which other hosts reach, with no credential: kvpool node"
        " refuses to start (with --insecure it would serve an open pool)",
        f'add "secret_file": "<this node\'s credential>" to {node.source or "the node config"}'
        f" (kvpool config render writes it), or set {ENV_SECRET_FILE}",
    )


def check_master_bind(config: MasterConfig | None, env_credential: bool) -> Check | None:
    """The master's flags: beyond loopback it needs a secret, or says it runs open."""
    if config is None:
        return None
    name = "security.master_bind"
    host = config.host
    if is_loopback(host):
        return pass_(name, f"the master binds {host}: reachable from this host only")
    if config.secret_file or env_credential:
        where = f"--secret_file {config.secret_file}" if config.secret_file else ENV_SECRET_FILE
        return pass_(name, f"the master binds {host} with a secret ({where})")
    if config.insecure:
        return warn(
            name,
            f"the master binds {host} with --insecure: the pool is open; any host that"
            " reaches its port can read, overwrite and remove every object and join as a node",
            OPEN_FIX,
        )
    return fail(
        name,
        f"the master binds {host}, which other hosts reach, with no secret: kvpool master"
        " refuses to start",
        f"add --secret_file PATH (or set {ENV_SECRET_FILE} where it runs); kvpool config"
        " render writes both",
    )
