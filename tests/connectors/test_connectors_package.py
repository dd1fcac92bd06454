from __future__ import annotations

from kvpool.testing.fresh import run_python


def test_package_import_is_lazy_and_names_resolve() -> None:
    code = (
        "import sys, kvpool.connectors as c\n"
        "assert 'vllm' not in sys.modules, 'importing the package imported vLLM'\n"
        "assert c.KVPoolStoreConnector.__module__ == 'kvpool.connectors.store.connector'\n"
        "try:\n"
        "    c.Nope\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    out = run_python(code, check=True)
    assert "has no attribute 'Nope'" in out.stdout
