"""Helpers for the operator tools' tests: a stand-in master answering /health and /metrics on a
real 127.0.0.1 socket, and helpers that build the production guide's configurations."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpool.net import free_port_runs

# What the master's /metrics shows (names from kvpool.master.metrics).
METRICS = (
    "# TYPE kvpool_kv_cache_blocks_total gauge\nkvpool_kv_cache_blocks_total 12345\n"
    "# TYPE kvpool_connected_clients gauge\nkvpool_connected_clients 8\n"
    "# TYPE kvpool_tier_used_bytes gauge\n"
    'kvpool_tier_used_bytes{tier="memory"} 500\nkvpool_tier_used_bytes{tier="ssd"} 0\n'
    "# TYPE kvpool_tier_capacity_bytes gauge\n"
    'kvpool_tier_capacity_bytes{tier="memory"} 1000\n'
    "# TYPE kvpool_prefix_blocks counter\n"
    'kvpool_prefix_blocks_total{result="queried"} 1000\n'
    'kvpool_prefix_blocks_total{result="hit"} 420\n'
)


class StandInMaster:
    """Serves what doctor reads from a master: /health, /metrics and /api/status."""

    def __init__(
        self,
        metrics: str = METRICS,
        health_status: int = 200,
        status: dict[str, Any] | None = None,
    ) -> None:
        self.metrics = metrics
        self.health_status = health_status
        self.status = status  # /api/status JSON; None: 404 like a master without it
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    status, body = owner.health_status, b'{"status":"ok"}'
                elif self.path == "/metrics":
                    status, body = 200, owner.metrics.encode()
                elif self.path == "/api/status" and owner.status is not None:
                    status, body = 200, json.dumps(owner.status).encode()
                else:
                    status, body = 404, b"not found"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandInMaster:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free right now."""
    return free_port_runs("127.0.0.1", [1] * count)


# The production guide's §5.2 and §5.3 --kv-transfer-config, verbatim.
GUIDE_PREFILL = """{
"kv_connector": "MultiConnector",
"kv_role": "kv_producer",
"kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {
"connectors": [
{
"kv_connector": "MooncakeConnectorV1",
"kv_role": "kv_producer",
"kv_port": "30000",
"kv_connector_extra_config": {
"prefill": {"dp_size": 4, "tp_size": 8},
"decode": {"dp_size": 8, "tp_size": 4}
}
},
{
"kv_connector": "AscendStoreConnector",
"kv_role": "kv_producer",
"kv_connector_extra_config": {
"lookup_rpc_port": "0",
"backend": "mooncake"
}
}
]
}
}"""
GUIDE_DECODE = """{
"kv_connector": "MultiConnector",
"kv_role": "kv_consumer",
"kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {
"connectors": [
{
"kv_connector": "MooncakeConnectorV1",
"kv_role": "kv_consumer",
"kv_port": "30100",
"kv_connector_extra_config": {
"prefill": {"dp_size": 4, "tp_size": 8},
"decode": {"dp_size": 8, "tp_size": 4}
}
},
{
"kv_connector": "AscendStoreConnector",
"kv_role": "kv_consumer",
"kv_connector_extra_config": {
"lookup_rpc_port": "0",
"load_async": true,
"backend": "mooncake"
}
}
]
}
}"""


# The production guide's §5.2 / §5.3 configurations, with kvpool's class names and module paths.
GUIDE_P: dict[str, Any] = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_producer",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "connectors": [
            {
                "kv_connector": "KVPoolTransferConnector",
                "kv_connector_module_path": "kvpool.connectors.transfer",
                "kv_role": "kv_producer",
                "kv_port": "30000",
                "kv_connector_extra_config": {
                    "prefill": {"dp_size": 4, "tp_size": 8},
                    "decode": {"dp_size": 8, "tp_size": 4},
                },
            },
            {
                "kv_connector": "KVPoolStoreConnector",
                "kv_connector_module_path": "kvpool.connectors.store",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"lookup_rpc_port": "0", "backend": "mooncake"},
            },
        ]
    },
}


def guide_p() -> dict[str, Any]:
    return copy.deepcopy(GUIDE_P)


def guide_d() -> dict[str, Any]:
    d = copy.deepcopy(GUIDE_P)
    d["kv_role"] = "kv_consumer"
    transfer, store = d["kv_connector_extra_config"]["connectors"]
    transfer["kv_role"] = store["kv_role"] = "kv_consumer"
    transfer["kv_port"] = "30100"
    store["kv_connector_extra_config"]["load_async"] = True
    return d


def guideify(config: dict[str, Any]) -> dict[str, Any]:
    """The same config under the production guide's own class names (no module paths)."""
    c = copy.deepcopy(config)
    transfer, store = c["kv_connector_extra_config"]["connectors"]
    transfer["kv_connector"], store["kv_connector"] = "MooncakeConnectorV1", "AscendStoreConnector"
    del transfer["kv_connector_module_path"], store["kv_connector_module_path"]
    return c


def children(config: dict[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = config["kv_connector_extra_config"]["connectors"]
    return result


def as_json(config: dict[str, Any]) -> str:
    return json.dumps(config)


MLA_MODEL = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "num_attention_heads": 128}
GQA_MODEL = {"model_type": "llama", "num_key_value_heads": 8, "num_attention_heads": 32}


def free_port_range(width: int) -> int:
    """A base port such that [base, base + width) is free now."""
    return free_port_runs("127.0.0.1", [width])[0]
