"""The documented ``--kv-transfer-config`` keeps resolving after the store connector became a
package: a user's existing JSON must not break."""

from __future__ import annotations

import json

from kvpool.testing.fresh import run_python

DOCUMENTED = (
    '{"kv_connector": "KVPoolStoreConnector",'
    ' "kv_connector_module_path": "kvpool.connectors.store"}'
)


def test_documented_json_resolves_the_class_as_vllm_does() -> None:
    # What vLLM's KVConnectorFactory.get_connector_class does with the two keys, in a
    # fresh interpreter so that nothing imported by other tests hides a missing import.
    code = (
        "import importlib, json, sys\n"
        f"config = json.loads({DOCUMENTED!r})\n"
        "module = importlib.import_module(config['kv_connector_module_path'])\n"
        "cls = getattr(module, config['kv_connector'])\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
        "assert issubclass(cls, KVConnectorBase_V1), cls\n"
        "assert cls.__name__ == config['kv_connector']\n"
        "transfer = sorted(m for m in sys.modules if m.startswith('kvpool.connectors.transfer'))\n"
        "print(json.dumps(transfer))\n"
    )
    out = run_python(code, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []  # the transfer connector stays out


def test_vllm_free_parts_import_without_vllm() -> None:
    code = (
        "import sys\n"
        "import kvpool.connectors.store, kvpool.connectors.store.scheduler\n"
        "import kvpool.connectors.store.plan, kvpool.connectors.store.pool\n"
        "import kvpool.connectors.store.lookup\n"
        "assert 'vllm' not in sys.modules, 'a vLLM-free part imported vLLM'\n"
    )
    run_python(code, timeout_s=120, check=True)
