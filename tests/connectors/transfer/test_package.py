"""The documented ``kv_connector_module_path`` keeps resolving, the way vLLM resolves it."""

from __future__ import annotations

from kvpool.testing.fresh import run_python


def _run(code: str) -> str:
    done = run_python(code)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_vllm_resolves_the_documented_module_path() -> None:
    # vLLM's KVConnectorFactory: importlib.import_module(kv_connector_module_path), then
    # getattr(module, kv_connector); MultiConnector later finds the class by name.
    out = _run(
        "import importlib, sys\n"
        "module = importlib.import_module('kvpool.connectors.transfer')\n"
        "assert 'vllm' not in sys.modules, 'importing the package imported vLLM'\n"
        "cls = getattr(module, 'KVPoolTransferConnector')\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
        "assert issubclass(cls, KVConnectorBase_V1)\n"
        "assert KVConnectorFactory.get_connector_class_by_name('KVPoolTransferConnector') is cls\n"
        "assert 'kvpool.connectors.store' not in sys.modules, 'loaded the store connector'\n"
        "assert module.TransferMetadata.__module__ == 'kvpool.connectors.transfer.connector'\n"
        "try:\n"
        "    module.Nope\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    assert "has no attribute 'Nope'" in out


def test_the_vllm_free_halves_import_without_vllm() -> None:
    _run(
        "import sys\n"
        "import kvpool.connectors.transfer.worker, kvpool.connectors.transfer.scheduler\n"
        "import kvpool.connectors.transfer.tcp, kvpool.config, kvpool.protocol.pull\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)[:3]\n"
        "assert 'torch' not in sys.modules\n"
    )
