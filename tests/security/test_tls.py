"""TLS settings into ``ssl`` contexts: off when unset, and every bad setting a one-line
error naming its key and the fix (the data port over TLS: tests/datapath/test_tls.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.security.tls import TLSConfig
from tests.tls_material import Material, make_material


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> Material:
    return make_material(tmp_path_factory.mktemp("tls"))


def test_bad_settings_are_one_line_errors(material: Material, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^tls_cert: .*nope.pem is not a file"):
        TLSConfig(str(tmp_path / "nope.pem"), material.server.key).server_context()
    with pytest.raises(ConfigError, match=r"^--tls_key: missing"):
        TLSConfig(material.server.cert, "", prefix="--tls_").server_context()
    with pytest.raises(ConfigError, match=r"^tls_key: .* is not the key of tls_cert"):
        TLSConfig(material.server.cert, material.client.key).server_context()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"^tls_cert/tls_key: cannot load"):
        TLSConfig(str(garbage), material.server.key).server_context()
    with pytest.raises(ConfigError, match=r"^KVPOOL_TLS_CA: .* holds no PEM certificate"):
        TLSConfig.from_env({"KVPOOL_TLS_CA": str(garbage)}).client_context()
    assert TLSConfig().server_context() is None and TLSConfig().client_context() is None
