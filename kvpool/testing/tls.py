"""Throwaway TLS material for tests and benchmarks: a CA and certificates it signs.

Made with Debian's ``openssl`` command, so nothing beyond the standard library is
imported; each certificate carries its host as a subjectAltName (``IP:`` or ``DNS:``),
which is what the host-name check compares with the address dialled.
"""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CertAuthority", "Issued"]

_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Issued:
    cert: str
    key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=_TIMEOUT_S)


def _key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
    )


@dataclass(frozen=True, slots=True)
class CertAuthority:
    directory: Path
    cert: str
    key: str

    @classmethod
    def create(cls, directory: Path, name: str = "kvpool test CA") -> CertAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        key, cert = (
            directory / f"{name.replace(' ', '-')}.key",
            directory / f"{name.replace(' ', '-')}.pem",
        )
        _key(key)
        _openssl(
            "req",
            "-x509",
            "-new",
            "-key",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            f"/CN={name}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        )
        return cls(directory, str(cert), str(key))

    def issue(self, name: str, host: str = "127.0.0.1") -> Issued:
        """A leaf certificate for ``host`` (a server's; it serves as a client's too)."""
        try:
            ipaddress.ip_address(host)
            san = f"IP:{host}"
        except ValueError:
            san = f"DNS:{host}"
        key, csr, cert = (self.directory / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
        ext = self.directory / f"{name}.ext"
        ext.write_text(
            f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
        )
        _key(key)
        _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            self.cert,
            "-CAkey",
            self.key,
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "2",
            "-extfile",
            str(ext),
        )
        return Issued(str(cert), str(key))
