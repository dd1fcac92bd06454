"""The transfer connector reads the node config that the store child reads: kvpool's, or
a Mooncake one (the guide's §5.2 / §5.3 on real Mooncake name one file for both).

The connector module imports vLLM, so it is read in a subprocess (as test_package does).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvpool.testing.fresh import run_python

VLLM_ASCEND_JSON = {
    "local_hostname": "10.0.0.2",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": "3.125GB",
    "local_buffer_size": 1073741824,
    "protocol": "tcp",
    "device_name": "",
    "master_server_address": "10.0.0.1:50051",
}
KVPOOL_JSON = {"local_hostname": "10.0.0.3", "metadata_server": "10.0.0.1:50088"}


def test_the_connector_reads_a_mooncake_json_and_a_kvpool_one(tmp_path: Path) -> None:
    (tmp_path / "mooncake.json").write_text(json.dumps(VLLM_ASCEND_JSON))
    (tmp_path / "kvpool.json").write_text(json.dumps(KVPOOL_JSON))
    names = ("mooncake.json", "kvpool.json")
    code = (
        "import sys\n"
        "from kvpool.connectors.transfer.connector import _node_config\n"
        "mc, kv = {'MOONCAKE_CONFIG_PATH': sys.argv[1]}, {'KVPOOL_CONFIG_PATH': sys.argv[2]}\n"
        "for env in (mc, kv, {}):\n"
        "    node = _node_config(env)\n"
        "    print(type(node).__name__, getattr(node, 'local_hostname', None))\n"
    )
    done = run_python(code, *(str(tmp_path / n) for n in names))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split("\n")[:3] == [
        "MooncakeNodeConfig 10.0.0.2",
        "NodeConfig 10.0.0.3",
        "NoneType None",
    ]
