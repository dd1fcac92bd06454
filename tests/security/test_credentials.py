"""The cluster secret's checks, the keys derived from it, and the grants they MAC."""

from __future__ import annotations

import pytest

from kvpool.errors import AuthError, ConfigError
from kvpool.security.credentials import Credential, check_grant, check_secret, key_for, make_grant

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


def test_a_grant_allows_its_range_operation_and_time_only() -> None:
    key = b"k" * 32
    grant = make_grant(key, "red", "seg", "r", 100, 50, until=1000)
    check_grant(key, "red", "seg", grant, "r", 100, 50, now_ms=1000)
    check_grant(key, "red", "seg", grant, "r", 120, 30, now_ms=0)  # inside it
    for tenant, segment, op, offset, length, now, why in (
        ("red", "seg", "r", 100, 51, 0, "outside its grant"),
        ("red", "seg", "r", 99, 10, 0, "outside its grant"),
        ("red", "seg", "w", 100, 50, 0, "outside its grant"),
        ("red", "seg", "r", 100, 50, 1001, "expired"),
        ("blue", "seg", "r", 100, 50, 0, "did not make"),
        ("red", "seg2", "r", 100, 50, 0, "did not make"),
    ):
        with pytest.raises(AuthError, match=why):
            check_grant(key, tenant, segment, grant, op, offset, length, now)
    with pytest.raises(AuthError, match="without a grant"):
        check_grant(key, "red", "seg", "", "r", 100, 50, 0)
    with pytest.raises(AuthError, match="did not make"):
        check_grant(b"x" * 32, "red", "seg", grant, "r", 100, 50, 0)
