"""TLS settings for kvpool's own TCP ports: a certificate, its key and a CA bundle.

Off unless configured.  A server needs ``cert`` and ``key`` (with ``ca``: mutual TLS); a
client needs ``ca`` (and ``cert``/``key`` when the server asks).  ssl's errors become
one-line config errors naming the key and the fix.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import ConfigError

__all__ = ["ENV_CA", "ENV_CERT", "ENV_KEY", "TLSConfig"]

ENV_CA = "KVPOOL_TLS_CA"
ENV_CERT = "KVPOOL_TLS_CERT"
ENV_KEY = "KVPOOL_TLS_KEY"


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """Paths (empty: unset).  ``prefix`` names the keys in errors (``--tls_`` for the
    master's flags, ``tls_`` for a node config's keys, ``KVPOOL_TLS_`` for the env)."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    prefix: str = "tls_"

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TLSConfig:
        env = os.environ if env is None else env
        return cls(
            cert=env.get(ENV_CERT, ""),
            key=env.get(ENV_KEY, ""),
            ca=env.get(ENV_CA, ""),
            prefix="KVPOOL_TLS_",
        )

    def _name(self, what: str) -> str:
        return self.prefix + (what.upper() if self.prefix.isupper() else what)

    def _file(self, what: str, path: str) -> str:
        if not Path(path).is_file():
            raise ConfigError(
                f"{self._name(what)}: {path} is not a file; give the path of a PEM file "
                f"(openssl can make one; docs/security.md#tls)"
            )
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{self._name(what)}: {path} is not readable by this user")
        return path

    def _load_chain(self, ctx: ssl.SSLContext) -> None:
        if bool(self.cert) != bool(self.key):
            missing, given = ("key", "cert") if self.cert else ("cert", "key")
            raise ConfigError(
                f"{self._name(missing)}: missing; {self._name(given)} needs its "
                f"{'private key' if missing == 'key' else 'certificate'} too"
            )
        cert = self._file("cert", self.cert)
        key = self._file("key", self.key)
        try:
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
                raise ConfigError(
                    f"{self._name('key')}: {key} is not the key of {self._name('cert')} "
                    f"{cert}; give the key the certificate was made for"
                ) from None
            raise ConfigError(
                f"{self._name('cert')}/{self._name('key')}: cannot load {cert} with "
                f"{key} ({exc.reason or exc}); both must be PEM, the key unencrypted"
            ) from None

    def _load_ca(self, ctx: ssl.SSLContext) -> None:
        ca = self._file("ca", self.ca)
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{self._name('ca')}: {ca} holds no PEM certificate ({exc.reason or exc})"
            ) from None

    def server_context(self) -> ssl.SSLContext | None:
        """The listening side's context (None: no certificate, so this process's own
        port stays plain; ``ca`` alone only verifies the servers it dials).  With ``ca``
        set, clients must present a certificate it signed."""
        if not self.cert and not self.key:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_chain(ctx)
        if self.ca:
            self._load_ca(ctx)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        """The dialling side's context (None: TLS off).  Without ``ca`` the system's
        trust store verifies the server."""
        if not self.enabled:
            return None
        # the default context keeps verification and the host-name check on: the server's
        # certificate is checked against the address dialled (for an IP address, its
        # subjectAltName must carry that IP)
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca:
            self._load_ca(ctx)
        if self.cert or self.key:
            self._load_chain(ctx)
        return ctx
