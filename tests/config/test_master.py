from __future__ import annotations

import shlex

import pytest

from kvpool.cli import build_parser
from kvpool.config import (
    MasterConfig,
    parse_node_config,
)
from kvpool.config.master import (
    MASTER_FLAGS,
    POLICY_FLAG_ALIASES,
    POLICY_FLAG_VALUES,
    REPLICA_FLAG_MAX,
)
from kvpool.core.eviction import (
    EVICTION_POLICIES,
    EVICTION_POLICY_ALIASES,
    canonical_eviction_policy,
    make_eviction_policy,
)
from kvpool.core.objects import MAX_REPLICAS
from kvpool.errors import ConfigError


def test_master_server_address_is_accepted_as_mooncake_spells_it() -> None:
    data = {"local_hostname": "h", "master_server_address": "m:1234"}
    assert parse_node_config(data).master_address == "m:1234"


def test_master_defaults_are_the_guides() -> None:
    cfg = MasterConfig()
    assert (cfg.host, cfg.port) == ("127.0.0.1", 50088)
    assert (cfg.eviction_high_watermark_ratio, cfg.eviction_ratio) == (0.9, 0.1)
    assert (cfg.default_kv_lease_ttl, cfg.client_ttl, cfg.enable_offload) == (11000, 120, False)
    assert cfg.client_ttl_ms == 120_000 and cfg.lease_ttl_ms == 11_000


def test_master_parses_the_guides_command_lines_as_written() -> None:
    line = (
        "mooncake_master --port 50088 --eviction_high_watermark_ratio 0.9 --eviction_ratio 0.1"
        " --default_kv_lease_ttl 11000 --enable_offload=true --client_ttl=120"
    )
    argv = shlex.split(line)
    cfg = MasterConfig.from_argv(argv)
    assert cfg.enable_offload is True and cfg.client_ttl == 120 and cfg.port == 50088
    dashed = MasterConfig.from_argv(
        ["kvpool", "master", "--eviction-ratio=0.2", "--segment-size", "4GiB", "--enable_offload"]
    )
    assert dashed.eviction_ratio == 0.2 and dashed.segment_size == 4 * 2**30
    assert dashed.enable_offload is True


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        ({"eviction_high_watermark_ratio": "1.5"}, "--eviction_high_watermark_ratio"),
        ({"eviction_ratio": "0"}, "--eviction_ratio"),
        ({"default_kv_lease_ttl": "-1"}, "--default_kv_lease_ttl"),
        ({"client_ttl": "0"}, "--client_ttl"),
        ({"port": "70000"}, "--port"),
        ({"enable_offload": "maybe"}, "--enable_offload"),
        ({"segment_size": "big"}, "--segment_size"),
        ({"eviction_policy": "random"}, "--eviction_policy"),
        ({"segment_warmup": "eager"}, "--segment_warmup"),
        ({"rpc_thread_num": "4"}, "--rpc_thread_num"),
        ({"replica_num": "9"}, "--replica_num"),
        ({"replica_num": "0"}, "--replica_num"),
    ],
)
def test_master_flags_out_of_range_name_the_flag(flags: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        MasterConfig.from_flags(flags)
    assert flag in str(err.value)


def test_master_typed_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match="--eviction_ratio"):
        MasterConfig(eviction_ratio=2.0)
    with pytest.raises(ConfigError, match="--segment_warmup"):
        MasterConfig(segment_warmup="eager")


def test_every_master_field_is_a_flag_declared_once() -> None:
    assert [f.name for f in MASTER_FLAGS] == list(MasterConfig.__dataclass_fields__)
    defaults = MasterConfig()
    for flag in MASTER_FLAGS:
        assert flag.default == getattr(defaults, flag.name), flag.name
        assert flag.help, flag.name


def test_kvpool_master_takes_every_flag_in_both_spellings_with_its_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["master", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for flag in MASTER_FLAGS:
        assert f"--{flag.name}" in text, flag.name
        assert f"--{flag.name.replace('_', '-')}" in text, flag.name
        assert f"(default {flag.shown_default})" in text, flag.name
    assert "(default 50088)" in text and "(default 1GiB)" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--enable_offload=on", "--port", "50099", "--eviction-ratio=0.2"],
        ["--enable-offload", "yes", "--port=50099", "--eviction_ratio", "0.2"],
        ["--port", "50099", "--eviction_ratio=0.2", "--enable_offload"],
    ],
)
def test_argparse_and_the_command_line_parser_read_the_same_table(argv: list[str]) -> None:
    from_argv = MasterConfig.from_argv(["kvpool", "master", *argv])
    args = build_parser().parse_args(["master", *argv])
    given = {f.name: getattr(args, f.name) for f in MASTER_FLAGS}
    from_cli = MasterConfig.from_flags({k: v for k, v in given.items() if v is not None})
    assert from_argv == from_cli
    assert (from_cli.enable_offload, from_cli.port, from_cli.eviction_ratio) == (True, 50099, 0.2)


def test_every_eviction_policy_and_alias_is_a_master_flag_value() -> None:
    """``--eviction_policy default`` (the name before ``prefix_aware``) keeps working, and the
    flag accepts exactly what the core can build."""
    assert MasterConfig().eviction_policy == "prefix_aware"
    for name in (*EVICTION_POLICIES, *EVICTION_POLICY_ALIASES):
        config = MasterConfig.from_argv(["mooncake_master", "--eviction_policy", name])
        assert make_eviction_policy(config.eviction_policy).name == (
            canonical_eviction_policy(name)
        )


def test_the_flags_name_what_the_core_implements() -> None:
    """config names the policies and the replica limit itself (it sits below core): the
    names must stay the core's, no more and no fewer."""
    assert POLICY_FLAG_VALUES == EVICTION_POLICIES
    assert dict(POLICY_FLAG_ALIASES) == dict(EVICTION_POLICY_ALIASES)
    assert REPLICA_FLAG_MAX == MAX_REPLICAS


def test_flags_that_would_do_nothing_are_named_in_warnings() -> None:
    assert MasterConfig().warnings() == []
    assert MasterConfig(enable_offload=True, ssd_offload_path="/ssd").warnings() == []
    (unused,) = MasterConfig(ssd_offload_path="/ssd").warnings()
    assert "--enable_offload" in unused
    (nowhere,) = MasterConfig(enable_offload=True).warnings()
    assert "--ssd_offload_path" in nowhere and "mooncake.json" in nowhere


def test_the_effective_flags_read_back_as_the_same_config() -> None:
    config = MasterConfig(
        port=50088, enable_offload=True, ssd_offload_path="/mnt/my ssd", eviction_policy="lru"
    )
    assert MasterConfig.from_argv(config.as_argv()) == config
    assert "'--ssd_offload_path=/mnt/my ssd'" in config.flags_line()
    assert MasterConfig.from_argv(MasterConfig().as_argv()) == MasterConfig()
