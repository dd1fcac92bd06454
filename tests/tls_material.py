"""The TLS tests' throwaway CA and certificates (one set per test session)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpool.testing.tls import CertAuthority, Issued


@dataclass(frozen=True)
class Material:
    ca: CertAuthority
    server: Issued  # for 127.0.0.1
    client: Issued
    other_ca: CertAuthority  # signed nothing here: trusting it trusts no server
    wrong_host: Issued  # signed by ``ca`` for 127.0.0.2


def make_material(directory: Path) -> Material:
    ca = CertAuthority.create(directory / "ca")
    other = CertAuthority.create(directory / "other", "another CA")
    return Material(
        ca, ca.issue("server"), ca.issue("client"), other, ca.issue("wrong", "127.0.0.2")
    )
