"""deploy/: the Grafana dashboard names only metrics a real master exports, and the Compose
file mirrors the production guide's §3.2 with commands kvpool itself accepts."""

from __future__ import annotations

import json
import re
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpool.cli import build_parser
from kvpool.client.client import Client
from kvpool.config import MasterConfig, load_node_config
from kvpool.config.values import parse_size
from kvpool.ops.render import parse_inventory, render
from kvpool.testing.processes import PoolProcess, start_master
from tests.deploy.grafana import all_panels, dashboard, exprs
from tests.deploy.traffic import master_flags, touch_every_counter

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
INVENTORY = DEPLOY.parent / "examples" / "inventory.toml"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"

_METRIC = re.compile(r"\bkvpool_[a-zA-Z0-9_]+")
# a selector: name{label="v", other=~"w"} (the label part is optional)
_SELECTOR = re.compile(r"\b(kvpool_[a-zA-Z0-9_]+)\s*(?:\{([^}]*)\})?")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")


# ---------------------------------------------------------------------------- grafana
def test_dashboard_is_grafana_json() -> None:
    data = dashboard()
    assert data["title"] == "kvpool" and data["uid"]
    assert isinstance(data["schemaVersion"], int)
    ids = [p["id"] for p in all_panels(data["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in data["templating"]["list"]}
    for panel in all_panels(data["panels"]):
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], f"{panel['title']}: no query"
            assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel.get("targets", []):
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in variables or var.startswith("__"), f"{var} in {target['expr']}"


def test_dashboard_covers_what_operators_ask() -> None:
    text = "\n".join(e for _, e in exprs())
    titles = " ".join(t for t, _ in exprs()).lower()
    # hit ratios divide by their denominators, and the denominators are charted too
    assert 'kvpool_hits_total{instance=~"$instance",kind="get"}' in text
    assert "/ sum(rate(kvpool_lookups_total" in text
    assert '/ sum(rate(kvpool_prefix_blocks_total{instance=~"$instance",result="queried"}' in text
    assert "denominators" in titles
    for needed in (
        "kvpool_tier_used_bytes",
        "kvpool_tier_capacity_bytes",
        "rate(kvpool_evictions_total",
        "rate(kvpool_offloads_total",
        "histogram_quantile(0.5, sum by (op, le) (rate(kvpool_request_seconds_bucket",
        "histogram_quantile(0.99, sum by (op, le) (rate(kvpool_request_seconds_bucket",
        "kvpool_connected_clients",
        "sum by (reason) (rate(kvpool_put_failures_total",
    ):
        assert needed in text, needed
    for _, expr in exprs():
        assert _METRIC.search(expr), f"{expr}: names no kvpool metric"


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real master's /metrics after traffic that touches every counter: puts, hits in
    both tiers, misses, offloads, SSD evictions, a refused put."""
    master: PoolProcess
    with start_master(*master_flags(tmp_path_factory.mktemp("ssd"))) as master:
        with Client(master.address, timeout_s=30) as c:
            touch_every_counter(c)
        with urllib.request.urlopen(f"http://{master.address}/metrics", timeout=10) as resp:
            return resp.read().decode()


@pytest.fixture(scope="module")
def scraped(exposition: str) -> dict[str, set[str]]:
    """Sample name -> label names."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_dashboard_names_only_metrics_a_master_exports(scraped: dict[str, set[str]]) -> None:
    # Compared with sample names as scraped (kvpool_puts_total, ..._bucket), which is what
    # PromQL selects on; a family name without its suffix would select nothing.
    assert "kvpool_offloads_total" in scraped and "kvpool_evictions_total" in scraped
    used: set[str] = set()
    for title, expr in exprs():
        for match in _SELECTOR.finditer(expr):
            name, matchers = match[1], match[2] or ""
            used.add(name)
            assert name in scraped, f"{title}: {name} is not in a master's /metrics"
            for label, _, _ in _MATCHER.findall(matchers):
                if label == "instance":  # added by Prometheus at scrape time
                    continue
                assert label in scraped[name], f"{title}: {name} has no label {label!r}"
    assert len(used) >= 15, sorted(used)


def test_the_metrics_reference_is_every_metric_the_master_registers(exposition: str) -> None:
    # every registered metric has its # TYPE line, with or without samples yet (a labelled
    # counter before its first event, a tenant's gauges before any tenant)
    exported = dict(re.findall(r"^# TYPE (kvpool_\w+) (\w+)$", exposition, flags=re.M))
    exported = {n: kind for n, kind in exported.items() if not n.endswith("_created")}
    doc = (DEPLOY.parent / "docs" / "monitoring.md").read_text(encoding="utf-8")
    documented = dict(re.findall(r"^\| `(kvpool_\w+)` \| (\w+) \|", doc, flags=re.M))
    assert documented == exported


def test_monitoring_doc_lists_every_exported_metric(scraped: dict[str, set[str]]) -> None:
    doc = (DEPLOY.parent / "docs" / "monitoring.md").read_text(encoding="utf-8")
    rows = {
        m[1]: m[2]
        for m in re.finditer(r"^\| `(kvpool_\w+)` \| \w+ \|(.*)$", doc, flags=re.MULTILINE)
    }
    for name, labels in scraped.items():
        if name.endswith("_created"):  # prometheus_client's per-series timestamps
            continue
        # counters are listed by their sample name (kvpool_puts_total), the histogram by
        # its family name (kvpool_request_seconds, whose samples are _bucket/_sum/_count)
        listed = name if name in rows else re.sub(r"_(bucket|sum|count)$", "", name)
        assert listed in rows, f"{name} is not in the metrics reference of docs/monitoring.md"
        for label in labels - {"le"}:
            assert f"`{label}`" in rows[listed], f"{name}: label {label!r} is not documented"


# ---------------------------------------------------------------------------- compose
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def interpolate(word: str) -> str:
    """Compose's ${VAR:-default} with nothing set: the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", word)


def argv(service: dict[str, Any]) -> list[str]:
    """The command line a service runs: its entrypoint, then its command."""
    return [interpolate(w) for w in [*service["entrypoint"], *service["command"]]]


def test_compose_mirrors_the_guides_compose_file() -> None:
    services = compose()["services"]
    assert set(services) == {"master", "node", "proxy"}
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        assert service["restart"] == "unless-stopped", name
        assert service["profiles"] == [name], name
        assert "kvpool" in service["image"], name
        # the entrypoint is set, so any image with kvpool installed runs it (a vLLM image's
        # own entrypoint is `vllm serve`)
        assert service["entrypoint"] == ["kvpool"], name
        assert argv(service)[:2] == ["kvpool", name], name
        assert all(isinstance(word, str) for word in service["command"]), name
    assert services["node"]["environment"]["KVPOOL_CONFIG_PATH"].endswith("mooncake.json")


def test_compose_master_command_has_the_guides_flags() -> None:
    words = argv(compose()["services"]["master"])
    config = MasterConfig.from_argv(words)
    assert config.port == 50088
    assert config.eviction_high_watermark_ratio == 0.9
    assert config.eviction_ratio == 0.1
    assert config.default_kv_lease_ttl == 11000
    assert config.host == "0.0.0.0"  # reachable from the other hosts
    # and kvpool's own parser takes the same words
    args = build_parser().parse_args(words[1:])
    assert args.command == "master" and args.default_kv_lease_ttl == "11000"


def test_compose_reads_the_secret_and_proxy_key_where_render_writes_them() -> None:
    # bound to 0.0.0.0, a master or node without a secret refuses to start (security.md),
    # and a proxy without an API key: every service must read the rendered files, at the
    # paths the rendered mooncake.json, env.sh and scripts name (one secret path, not two)
    services = compose()["services"]
    files = render(parse_inventory(tomllib.loads(INVENTORY.read_text())))
    rendered_node = json.loads(files["p0/mooncake.json"])
    config = MasterConfig.from_argv(argv(services["master"]))
    assert config.secret_file == rendered_node["secret_file"] == "/workspace/config/secret"
    assert f"--secret_file {config.secret_file}" in files["master.sh"]
    assert services["node"]["environment"]["KVPOOL_SECRET_FILE"] == config.secret_file
    assert f"KVPOOL_SECRET_FILE={config.secret_file}" in files["p0/env.sh"]
    proxy = services["proxy"]["command"]
    key_file = proxy[proxy.index("--api-key-file") + 1]
    assert f"--api-key-file {key_file}" in files["proxy.sh"]
    for name, service in services.items():  # the rendered folder is mounted everywhere
        mounts = [*compose()["x-kvpool"]["volumes"], *service.get("volumes", [])]
        assert any(m.split(":")[1] == "/workspace/config" for m in mounts), name


def test_compose_master_has_room_for_its_segment_in_dev_shm() -> None:
    # Docker's default /dev/shm is 64 MiB: the master's segment needs the host's (ipc:
    # host, as the node has) or a shm_size that holds it, or it refuses to start.
    master = compose()["services"]["master"]
    config = MasterConfig.from_argv(argv(master))
    assert config.segment_size > 64 << 20
    if master.get("ipc") != "host":
        assert "shm_size" in master, "the master needs ipc: host or a shm_size"
        assert parse_size(str(master["shm_size"]), key="shm_size") >= config.segment_size


def test_compose_node_and_proxy_commands_parse() -> None:
    services = compose()["services"]
    parser = build_parser()
    node = parser.parse_args(argv(services["node"])[1:])
    assert node.command == "node" and node.data_port == 0
    proxy = parser.parse_args(argv(services["proxy"])[1:])
    assert proxy.command == "proxy" and proxy.port == 8000
    assert proxy.prefill and proxy.decode


def test_compose_example_node_config_loads() -> None:
    config = load_node_config(COMPOSE.parent / "mooncake.json", env={})
    assert config.master_address == "10.0.0.1:50088"
    assert config.enable_ssd_offload and config.ssd_offload_path == "/mnt/nvme/kvpool_ssd"
    assert config.ssd_offload_limit == 1000 * 2**30
