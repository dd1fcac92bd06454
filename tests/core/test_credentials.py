"""The cluster secret's checks and the keys derived from it."""

from __future__ import annotations

import pytest

from kvpool.core.credentials import Credential, check_secret, key_for
from kvpool.errors import AuthError, ConfigError

SECRET = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"


def test_a_good_secret_is_taken_with_its_whitespace_trimmed() -> None:
    assert check_secret(f"  {SECRET}\n", "KVPOOL_SECRET") == SECRET.encode()


@pytest.mark.parametrize(
    ("text", "says"),
    [("", "empty"), ("   \n", "empty"), ("abc123", "6 characters"), ("ab" * 20, "pattern")],
)
def test_weak_secrets_are_refused_naming_the_key_and_the_fix(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_secret(text, "--secret_file (/etc/kvpool/secret)")
    message = str(err.value)
    assert message.startswith("--secret_file (/etc/kvpool/secret): ")
    assert says in message and "openssl rand -hex 32" in message and "\n" not in message


def test_node_keys_differ_per_node_and_per_secret() -> None:
    one = Credential.parse(SECRET, "k")
    other = Credential.parse(SECRET[::-1], "k")
    assert one.node_key_of("node-a") != one.node_key_of("node-b")
    assert one.node_key_of("node-a") != other.node_key_of("node-a")
    assert one.client_key() not in (one.node_key_of("node-a"), other.client_key())
    assert one.operator_token() != other.operator_token()
    assert len(one.operator_token()) == 64


def test_a_node_credential_is_that_node_and_nothing_else() -> None:
    cluster = Credential.parse(SECRET, "k")
    text = cluster.node_credential("node-a")
    node = Credential.parse(text, "secret_file")
    assert node.node_id == "node-a" and not node.is_cluster
    assert key_for(node, "node", "node-a", "master") == cluster.node_key_of("node-a")
    assert key_for(node, "data", "master", "node-a") == cluster.node_key_of("node-a")
    with pytest.raises(AuthError, match="node-a's and cannot act for node-b"):
        key_for(node, "node", "node-b", "master")
    with pytest.raises(AuthError, match="cannot be a client"):
        key_for(node, "client", "c1", "master")
    with pytest.raises(AuthError, match="no operator token"):
        node.operator_token()


@pytest.mark.parametrize("text", ["kvpool-node:node-a:zz", "kvpool-node::" + "00" * 32])
def test_a_broken_node_credential_says_its_form(text: str) -> None:
    with pytest.raises(ConfigError, match="kvpool-node:<node id>:<64 hex digits>"):
        Credential.parse(text, "secret_file")
