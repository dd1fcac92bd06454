"""The proxy's API keys: where they come from, and checking a request's ``Authorization``.

OpenAI's ``Authorization: Bearer KEY`` (as ``vllm serve --api-key``), not the cluster
secret's handshake, which is for kvpool's own binary ports that OpenAI clients do not speak.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence

from kvpool.errors import ConfigError
from kvpool.security.secret import require_private_file

__all__ = [
    "ENV_API_KEY",
    "ENV_API_KEY_FILE",
    "ENV_UPSTREAM_API_KEY",
    "ENV_UPSTREAM_API_KEY_FILE",
    "MIN_KEY_CHARS",
    "ApiKeys",
    "check_key",
    "read_key_file",
    "resolve_api_keys",
    "resolve_upstream_key",
]

ENV_API_KEY = "KVPOOL_API_KEY"
ENV_API_KEY_FILE = "KVPOOL_API_KEY_FILE"
ENV_UPSTREAM_API_KEY = "KVPOOL_UPSTREAM_API_KEY"
ENV_UPSTREAM_API_KEY_FILE = "KVPOOL_UPSTREAM_API_KEY_FILE"
# The proxy's own key guards every prompt sent through it: a short one is guessable.
# An upstream key is whatever the vLLM instances were started with, so only its shape
# is checked.
MIN_KEY_CHARS = 16
_FIX = "make one with `openssl rand -hex 32`"


def check_key(source: str, key: str, *, min_chars: int = MIN_KEY_CHARS) -> str:
    """``key`` without surrounding whitespace, if it can travel in a header and is long
    enough; ``source`` names where it came from."""
    key = key.strip()
    if not key:
        raise ConfigError(f"{source}: the API key is empty; {_FIX}")
    if not all("!" <= ch <= "~" for ch in key):
        raise ConfigError(
            f"{source}: an API key must be printable ASCII without spaces (it travels in "
            f"an HTTP header); {_FIX}"
        )
    if len(key) < min_chars:
        raise ConfigError(
            f"{source}: the API key has {len(key)} characters, fewer than {min_chars}; {_FIX}"
        )
    return key


def read_key_file(path: str, source: str, *, min_chars: int = MIN_KEY_CHARS) -> tuple[str, ...]:
    """The keys in the file at ``path``, one a line (blank lines and ``#`` comments
    skipped); a file every user of the host may read or write is refused."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(f"{source}: cannot read the key file {path} ({why})") from None
    require_private_file(path, mode, source, "key file")
    lines = [ln.strip() for ln in text.splitlines()]
    keys = tuple(
        check_key(f"{source} ({path})", ln, min_chars=min_chars)
        for ln in lines
        if ln and not ln.startswith("#")
    )
    if not keys:
        raise ConfigError(f"{source}: {path} holds no API key; {_FIX}")
    return keys


def _resolve(
    flag: str,
    keys: Sequence[str],
    key_file: str,
    env: Mapping[str, str],
    env_key: str,
    env_file: str,
    min_chars: int,
) -> tuple[str, ...]:
    if keys and key_file:
        raise ConfigError(f"{flag} and {flag}-file: give the key one way, not both")
    if keys:
        return tuple(check_key(flag, k, min_chars=min_chars) for k in keys)
    if key_file:
        return read_key_file(key_file, f"{flag}-file", min_chars=min_chars)
    if env.get(env_file):
        return read_key_file(env[env_file], env_file, min_chars=min_chars)
    if env.get(env_key):
        return (check_key(env_key, env[env_key], min_chars=min_chars),)
    return ()


# Sources of the proxy's own keys, first found wins (as the cluster secret's,
# :mod:`kvpool.security.secret`):
#
# 1. ``--api-key KEY`` (repeatable) or ``--api-key-file PATH`` (one key a line);
# 2. ``KVPOOL_API_KEY_FILE``, a file;
# 3. ``KVPOOL_API_KEY``, the key itself.
def resolve_api_keys(keys: Sequence[str], key_file: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """The proxy's own keys (any of them is accepted); empty when none is configured."""
    return _resolve("--api-key", keys, key_file, env, ENV_API_KEY, ENV_API_KEY_FILE, MIN_KEY_CHARS)


# The key sent on to P and D: ``--upstream-api-key`` / ``--upstream-api-key-file`` /
# ``KVPOOL_UPSTREAM_API_KEY_FILE`` / ``KVPOOL_UPSTREAM_API_KEY``, else the proxy's first own
# key (vLLM instances started with the same ``--api-key``), else none: then the client's own
# ``Authorization`` header is passed on as it came.
def resolve_upstream_key(key: str, key_file: str, env: Mapping[str, str]) -> str | None:
    """The key the proxy sends to P and D when set explicitly; None leaves the default."""
    found = _resolve(
        "--upstream-api-key",
        [key] if key else [],
        key_file,
        env,
        ENV_UPSTREAM_API_KEY,
        ENV_UPSTREAM_API_KEY_FILE,
        1,
    )
    if len(found) > 1:
        raise ConfigError("--upstream-api-key-file: holds several keys; P and D get one")
    return found[0] if found else None


class ApiKeys:
    """Checks an ``Authorization`` header against the configured keys.

    Both sides are hashed before :func:`hmac.compare_digest`, as vLLM does, so neither
    the key's characters nor its length leak through the time a refusal takes, and every
    key is compared (no early exit on the first match)."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def problem(self, authorization: str | None) -> str | None:
        """Why a request with this header may not pass, or None when it may."""
        if not authorization:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the Authorization header must be 'Bearer <key>'"
        presented = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        match = False
        for digest in self._digests:
            match |= hmac.compare_digest(presented, digest)
        return None if match else "incorrect API key provided"
