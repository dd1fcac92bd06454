from __future__ import annotations

import json

import pytest

from kvpool.config import Topology
from kvpool.errors import ConfigError
from kvpool.ops.kvconfig import (
    ConnectorSpec,
    command_argv,
    parse_kv_transfer_config,
    parse_kv_transfer_text,
    parse_vllm_command,
)
from tests.ops.helpers import GUIDE_PREFILL, guide_p, guideify

# The production guide's §5.2 command exactly as printed: JSON spanning lines inside single quotes.
GUIDE_PREFILL_COMMAND = (
    f"vllm serve /workspace/GLM-5.2-w8a8 \\\n--kv-transfer-config '{GUIDE_PREFILL}'"
)


def test_the_guides_command_line_is_read_as_a_shell_would() -> None:
    command = parse_vllm_command(GUIDE_PREFILL_COMMAND)
    assert command.model == "/workspace/GLM-5.2-w8a8"
    assert command.topology is None  # no -tp/-dp on the guide's line
    assert command.kv_transfer_config is not None
    config = parse_kv_transfer_text(command.kv_transfer_config)
    assert config.top.name == "MultiConnector"
    assert [c.name for c in config.children] == ["MooncakeConnectorV1", "AscendStoreConnector"]
    assert config.transfer is not None and config.transfer.port("kv_port") == 30000
    assert config.transfer.topology("decode") == Topology(8, 4)


def test_parallel_flags_in_every_spelling() -> None:
    kv = json.dumps(guide_p())
    for flags in ("-tp 8 -dp 4", "--tensor-parallel-size=8 --data-parallel-size 4"):
        command = parse_vllm_command(
            f"vllm serve /m {flags} --port 8100 --kv-transfer-config '{kv}'"
        )
        assert command.topology == Topology(4, 8)
        assert command.port == 8100
    command = parse_vllm_command(f"vllm serve --model /m --kv_transfer_config='{kv}'")
    assert command.model == "/m" and command.kv_transfer_config == kv


def test_a_shell_script_around_the_command_is_understood() -> None:
    script = (
        "#!/bin/sh\n# comment with 'quotes\nset -e\n"
        '. "$(dirname "$0")/env.sh"\n'
        f"exec vllm serve /m -tp 2 --kv-transfer-config '{json.dumps(guide_p())}'\n"
    )
    command = parse_vllm_command(script)
    assert command.model == "/m" and command.topology == Topology(1, 2)
    assert command_argv("x=1\nkvpool master --port 1", ("master",)) == ["master", "--port", "1"]


def test_unbalanced_quotes_and_bad_numbers_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="split"):
        parse_vllm_command("vllm serve /m --kv-transfer-config '{")
    with pytest.raises(ConfigError, match="not a number"):
        parse_vllm_command("vllm serve /m -tp eight")


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([], "expected a JSON object"),
        ({"kv_role": "kv_producer"}, "kv_connector"),
        ({"kv_connector": "MultiConnector"}, "connectors"),
        ({"kv_connector": "MultiConnector", "kv_connector_extra_config": []}, "JSON object"),
        (
            {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [1]}},
            "connectors[0]",
        ),
    ],
)
def test_malformed_configs_are_named(data: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_kv_transfer_config(data)
    assert fragment in str(err.value)


def test_bad_json_names_the_line() -> None:
    with pytest.raises(ConfigError, match="line 2"):
        parse_kv_transfer_text('{\n"kv_connector": }')


def test_mooncake_and_ascend_names_are_recognised_by_kind() -> None:
    config = parse_kv_transfer_config(guideify(guide_p()))
    assert config.transfer is not None and config.transfer.is_guide_name
    assert config.store is not None and config.store.name == "AscendStoreConnector"


def test_a_topology_block_reads_as_the_connectors_read_it() -> None:
    # one parser for connectors and doctor: what the connector accepts, doctor accepts
    def spec(block: object) -> ConnectorSpec:
        entry = {"kv_connector": "KVPoolTransferConnector", "kv_connector_extra_config": {}}
        entry["kv_connector_extra_config"] = {"decode": block}
        return parse_kv_transfer_config(entry).top

    assert spec({"tp_size": 4}).topology("decode") == Topology(1, 4)
    assert spec({"dp_size": "2", "tp_size": "4"}).topology("decode") == Topology(2, 4)
    assert spec({"dp_size": 2, "tp_size": 4}).topology("prefill") is None
    told = spec({"tp": 4}).topology("decode")
    assert isinstance(told, str) and '"decode"' in told and "unknown key" in told
    told = spec({"dp_size": 0, "tp_size": 4}).topology("decode")
    assert isinstance(told, str) and "dp_size" in told


def test_a_vllm_command_keeps_the_switches_that_shape_its_kv_cache() -> None:
    command = parse_vllm_command(
        "vllm serve /m --enable_prefix_caching --disable-hybrid-kv-cache-manager"
        " --enforce-eager --kv-transfer-config '{}'"
    )
    assert command.switches == {"--enable-prefix-caching", "--disable-hybrid-kv-cache-manager"}
