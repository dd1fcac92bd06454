from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.config import (
    Timeouts,
    parse_bool_value,
    parse_host_port,
    parse_size,
    parse_timeouts,
)
from kvpool.config.values import format_size, parse_warmup
from kvpool.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GB", 4 * 2**30),  # Mooncake's GB: a mooncake.json copied from it means the same
        ("4G", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("1.5 GB", 3 * 2**29),
        ("1073741824000", 1073741824000),
        (1073741824000, 1073741824000),
        ("2TiB", 2 * 2**40),
        ("2tb", 2 * 2**40),
        ("0.5kB", 512),
        (" 7 B ", 7),
    ],
)
def test_parse_size_reads_units_as_mooncake_does(text: object, expected: int) -> None:
    assert parse_size(text, key="global_segment_size") == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("4 bananas", "unknown size unit"),
        ("-4GB", "cannot read"),
        ("1.5", "whole number"),
        ("0.1 B", "whole number"),
        (True, "expected a size"),
        (-1, "negative"),
        (1.5, "expected a size"),
    ],
)
def test_parse_size_refuses_bad_values_naming_the_key(text: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(text, key="ssd_offload_limit")
    assert "ssd_offload_limit" in str(err.value)
    assert fragment in str(err.value)


@given(st.integers(min_value=0, max_value=2**50))
def test_parse_size_of_plain_bytes_round_trips(n: int) -> None:
    assert parse_size(str(n), key="k") == n
    assert parse_size(f"{n}B", key="k") == n


def test_timeouts_env_wins_and_kvpool_names_win_over_ascend() -> None:
    assert parse_timeouts({}) == Timeouts(10_000, 10_000)
    env = {"ASCEND_CONNECT_TIMEOUT": "20000", "ASCEND_TRANSFER_TIMEOUT": "15000"}
    assert parse_timeouts(env, connect_ms=5) == Timeouts(20_000, 15_000)
    env["KVPOOL_TRANSFER_TIMEOUT"] = "3000"
    assert parse_timeouts(env).transfer_timeout_ms == 3000
    assert parse_timeouts({}, connect_ms=7, transfer_ms="8") == Timeouts(7, 8)
    with pytest.raises(ConfigError, match="ASCEND_CONNECT_TIMEOUT"):
        parse_timeouts({"ASCEND_CONNECT_TIMEOUT": "soon"})


def test_parse_host_port_accepts_ipv6_brackets() -> None:
    assert parse_host_port("[::1]:50088", key="m") == ("::1", 50088)
    with pytest.raises(ConfigError, match="m: expected host:port"):
        parse_host_port(":50088", key="m")


@pytest.mark.parametrize("word", ["true", "1", "yes", "on", "TRUE", " Yes ", "On"])
def test_one_bool_parser_takes_every_true_word(word: str) -> None:
    assert parse_bool_value(word, key="k") is True


@pytest.mark.parametrize("word", ["false", "0", "no", "off", "False", " NO ", "Off"])
def test_one_bool_parser_takes_every_false_word(word: str) -> None:
    assert parse_bool_value(word, key="k") is False


@pytest.mark.parametrize("value", ["maybe", "", "2", 1, 0, None, 1.0])
def test_the_bool_parser_refuses_anything_else_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="enable_ssd_offload: expected true or false"):
        parse_bool_value(value, key="enable_ssd_offload")
    assert parse_bool_value(True, key="k") is True and parse_bool_value(False, key="k") is False


def mooncake_size(text: str) -> int:
    """Mooncake's own parser (the wheel's mooncake_config.py, installed by the mooncake
    extra), the reference for what a mooncake.json's sizes mean."""
    from mooncake.mooncake_config import _parse_segment_size

    return int(_parse_segment_size(text))


@pytest.mark.parametrize(
    "text", ["64GB", "4gb", "512MB", "1.5GB", "2TB", "3355443200", "16MB", "4G", "8k", "7b"]
)
def test_a_mooncake_size_means_the_same_bytes_to_kvpool_and_to_mooncake(text: str) -> None:
    assert parse_size(text, key="global_segment_size") == mooncake_size(text)


@given(st.integers(min_value=1, max_value=2**44))
def test_a_size_kvpool_writes_for_mooncake_reads_back_the_same(n: int) -> None:
    # what render writes into a Mooncake mooncake.json: plain bytes
    assert mooncake_size(str(n)) == parse_size(str(n), key="k") == n


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("background", "background"),
        (" SYNC ", "sync"),
        ("off", "off"),
        (True, "background"),
        ("false", "off"),
        ("no", "off"),
    ],
)
def test_parse_warmup_takes_each_mode_and_a_boolean(value: object, mode: str) -> None:
    assert parse_warmup(value, key="segment_warmup") == mode


@pytest.mark.parametrize("value", ["eager", "", None, 2])
def test_parse_warmup_refuses_anything_else_naming_the_key_and_the_modes(value: object) -> None:
    with pytest.raises(ConfigError, match=r"segment_warmup: .* use background .* sync .* off"):
        parse_warmup(value, key="segment_warmup")


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 1023, 1024, 3 * 2**30, 2**41)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "3.0 GiB",
        "2.0 TiB",
    ]
