"""The ``kvpool`` command: parse → options → ``run(options)``.  Nothing else lives here.

:func:`main` is the one place where a ``ConfigError`` becomes a one-line message on stderr
and exit status 2.  Commands import their implementation lazily, so that ``kvpool --help``
stays fast and ``kvpool doctor`` works on a host without vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from kvpool import __version__
from kvpool.config.master import MASTER_FLAGS
from kvpool.errors import ConfigError
from kvpool.net import DEFAULT_MASTER_PORT

__all__ = ["build_parser", "main"]

_POLICIES = ["round_robin", "least_inflight", "prefix_affinity", "kv_aware", "least_loaded"]


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs: object) -> None:
    """Add ``--name`` under both spellings: ``--snake_case`` (as Mooncake and the
    production guide write them) and ``--kebab-case``.  argparse itself accepts
    ``--flag value`` and ``--flag=value``."""
    spellings = [f"--{name}"]
    kebab = name.replace("_", "-")
    if kebab != name:
        spellings.append(f"--{kebab}")
    parser.add_argument(*spellings, dest=name, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a KV-cache pool for prefill/decode-disaggregated LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.set_defaults(run=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_master(sub)
    _add_node(sub)
    _add_doctor(sub)
    _add_config(sub)
    _add_proxy(sub)
    _add_status(sub)
    _add_up(sub)
    _add_secret(sub)
    _add_quota(sub)
    return parser


def _add_proxy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "proxy",
        help="OpenAI-compatible P/D proxy: prefill (max_tokens=1), then decode, streamed",
        description="Each request goes to a prefill endpoint with max_tokens=1 and "
        "kv_transfer_params={do_remote_decode: true}; the prefill's token goes to the client "
        "at once, and a decode endpoint continues from it with the kv_transfer_params the "
        "prefill returned (docs/proxy.md).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    multi = {"action": "extend", "nargs": "+", "metavar": "URL", "default": []}
    add_flag(p, "prefill", help="prefill endpoint(s), e.g. http://127.0.0.1:8100", **multi)
    add_flag(p, "decode", help="decode endpoint(s), e.g. http://127.0.0.1:8200", **multi)
    add_flag(
        p,
        "policy",
        default=None,
        choices=_POLICIES,
        help="how to pick the prefill endpoint (and the decode one, see --decode-policy);"
        " default: kv_aware with --kv-events, else round_robin",
    )
    add_flag(
        p,
        "kv_events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY]",
        help="a prefill's KV events: its URL, the ZMQ endpoint its vLLM publishes on"
        " (--kv-events-config) and, optionally, its replay endpoint (repeatable)",
    )
    add_flag(
        p,
        "kv_no_pool",
        action="store_true",
        help="kv_aware weighs the instances' own caches only, not what the pool holds",
    )
    add_flag(
        p,
        "kv_max_blocks",
        type=int,
        default=200_000,
        help="kv_aware remembers at most this many blocks per instance and for the pool",
    )
    add_flag(
        p,
        "decode_policy",
        choices=_POLICIES,
        help="decode policy (default: --policy; least_inflight with prefix_affinity)",
    )
    add_flag(
        p,
        "prefix_chars",
        type=int,
        default=256,
        help="prefix_affinity hashes this many leading prompt chars (or token ids)",
    )
    add_flag(p, "connect_timeout", type=float, default=5.0, help="upstream connect timeout, s")
    add_flag(
        p,
        "read_timeout",
        type=float,
        default=300.0,
        help="upstream read timeout between two chunks, s",
    )
    add_flag(p, "health_interval", type=float, default=2.0, help="seconds between /health polls")
    add_flag(p, "health_timeout", type=float, default=2.0, help="timeout of one /health poll, s")
    add_flag(
        p,
        "shutdown_timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish",
    )
    add_flag(p, "max_connections", type=int, default=1024, help="upstream connection pool size")
    add_flag(
        p,
        "api_key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: "
        "KVPOOL_API_KEY_FILE, KVPOOL_API_KEY; prefer --api-key-file)",
    )
    add_flag(p, "api_key_file", default="", metavar="PATH", help="file with the key(s), one a line")
    add_flag(
        p,
        "upstream_api_key",
        default="",
        metavar="KEY",
        help="key sent to P and D (default: KVPOOL_UPSTREAM_API_KEY[_FILE], else the first "
        "--api-key, as `vllm serve --api-key` instances expect)",
    )
    add_flag(p, "upstream_api_key_file", default="", metavar="PATH", help="file with that key")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without an API key (default: refuse; docs/security.md)",
    )
    add_flag(p, "open_metrics", action="store_true", help="serve /metrics without the API key")
    add_flag(
        p,
        "first_token_from",
        default="prefill",
        choices=("prefill", "decode"),
        help="prefill: the client gets P's token at once and D continues from it (default); "
        "decode: D answers the whole request and only D's tokens are sent",
    )
    p.set_defaults(run=_run_proxy, command_name=p.prog)


def _run_proxy(args: argparse.Namespace) -> int:
    from kvpool.ops.serve import run_proxy
    from kvpool.proxy import ProxyConfig
    from kvpool.proxy.auth import resolve_api_keys, resolve_upstream_key
    from kvpool.proxy.kv_feed import parse_event_source

    api_keys = resolve_api_keys(args.api_key, args.api_key_file, os.environ)
    upstream_key = resolve_upstream_key(
        args.upstream_api_key, args.upstream_api_key_file, os.environ
    )
    return run_proxy(
        ProxyConfig(
            prefill=tuple(args.prefill),
            decode=tuple(args.decode),
            host=args.host,
            port=args.port,
            policy=args.policy or ("kv_aware" if args.kv_events else "round_robin"),
            decode_policy=args.decode_policy,
            kv_events=tuple(parse_event_source(text) for text in args.kv_events),
            kv_max_blocks=args.kv_max_blocks,
            kv_pool=not args.kv_no_pool,
            prefix_chars=args.prefix_chars,
            connect_timeout_s=args.connect_timeout,
            read_timeout_s=args.read_timeout,
            health_interval_s=args.health_interval,
            health_timeout_s=args.health_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
            max_connections=args.max_connections,
            api_keys=api_keys,
            upstream_api_key=upstream_key,
            insecure=args.insecure,
            open_metrics=args.open_metrics,
            first_token_from=args.first_token_from,
        )
    )


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="the whole P/D stack on this machine: master, prefill + decode vLLM, proxy",
        description="Starts kvpool master (memory segment + SSD tier in --state-dir), the "
        "prefill and decode vLLM instances with kvpool's connectors under vLLM's "
        "MultiConnector (kv_load_failure_policy=recompute), and kvpool proxy; waits until "
        "all are healthy, prints the endpoints and a curl to paste, and stops everything on "
        "Ctrl-C or SIGTERM.  --engine mooncake runs the pool on real Mooncake instead: the "
        "wheel's mooncake_master with the guide's flags, Mooncake Store in every vLLM "
        "instance (whose Transfer Engine ports listen on every interface).  Port flags take "
        "0 for any free port.",
    )
    add_flag(
        p, "engine", default="kvpool", choices=("kvpool", "mooncake"),
        help="the pool: kvpool's master (default) or real Mooncake (mooncake_master + Store)",
    )  # fmt: skip
    add_flag(
        p, "state_dir",
        help="logs, SSD tier, model, mooncake.json (default: $KVPOOL_STATE_DIR, "
        "$XDG_STATE_HOME/kvpool/up, else ./.kvpool-state)",
    )  # fmt: skip
    p.add_argument("--model", help="a model directory (default: build a small Llama locally)")
    add_flag(p, "no_vllm", action="store_true", help="start the pool (master) alone")
    add_flag(
        p,
        "ha",
        action="store_true",
        help="two masters electing a leader on a local etcd, the pool's memory on a node"
        " (watch a failover: docs/ha.md)",
    )
    from kvpool.ops.up.options import PORT_FLAGS, port_default

    for name, _, text in PORT_FLAGS:
        default = port_default(name)
        add_flag(p, name, type=int, default=default, help=f"{text} (default {default})")
    add_flag(p, "prefill_instances", type=int, default=1, help="prefill instances (1)")
    add_flag(p, "decode_instances", type=int, default=1, help="decode instances (1)")
    for side in ("prefill", "decode"):
        for key, what in (("tp", "tensor"), ("dp", "data")):
            add_flag(
                p, f"{side}_{key}", type=int, default=1,
                help=f"{what}-parallel size of each {side} instance (vLLM -{key}; 1); the "
                f"peer's --kv-transfer-config gets it as \"{side}\": {{\"{key}_size\": N}}",
            )  # fmt: skip
    add_flag(
        p, "segment_size", default="256MiB",
        help="the master's memory segment; mooncake: each vLLM instance's (256MiB)",
    )  # fmt: skip
    add_flag(p, "ssd_limit", default="1GiB", help="cap of the SSD tier (1GiB; kvpool engine)")
    add_flag(p, "kv_cache_bytes", default="64MiB", help="vLLM KV cache per instance (64MiB)")
    add_flag(p, "max_model_len", type=int, default=2048, help="vLLM --max-model-len (2048)")
    add_flag(p, "dtype", help="vLLM --dtype (float32 for the small model, else auto)")
    add_flag(p, "served_model_name", help="the model name requests use")
    add_flag(
        p, "policy", default="kv_aware",
        choices=_POLICIES, help="proxy routing (kv_aware: from the prefills' KV events)",
    )  # fmt: skip
    add_flag(p, "cpus", help="cores for the vLLM instances, e.g. 0,1 (default: all usable)")
    add_flag(
        p,
        "vllm_args",
        default="",
        help='extra vLLM flags for every instance, one string: --vllm-args="--foo 1 --bar"',
    )
    add_flag(p, "start_timeout", type=float, default=300.0, help="seconds to become healthy")
    add_flag(p, "stop_timeout", type=float, default=20.0, help="SIGTERM grace before SIGKILL, s")
    p.set_defaults(run=_run_up, command_name=p.prog)


def _run_up(args: argparse.Namespace) -> int:
    from kvpool.ops import up

    opts = up.options_from_args(args, os.environ, up.usable_cpus(), sys.executable)
    return up.run(opts)


def _add_master(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "master",
        help="run the pool's metadata service (with an embedded memory segment by default)",
        description="Flags take Mooncake's spellings: --flag value, --flag=value, "
        "snake_case or kebab-case, booleans as true/false (or yes/no, on/off, 1/0).",
    )
    # Values stay strings here: MasterConfig.from_flags parses them (one parser per flag,
    # shared with doctor's --master-cmd), and an absent flag keeps MasterConfig's default.
    for flag in MASTER_FLAGS:
        bare = {"nargs": "?", "const": "true"} if flag.is_bool else {}
        add_flag(p, flag.name, help=f"{flag.help} (default {flag.shown_default})", **bare)
    add_flag(p, "log_level", help="debug, info (default), warning")
    p.set_defaults(run=_run_master, command_name=p.prog)


def _run_master(args: argparse.Namespace) -> int:
    from kvpool.config import MasterConfig
    from kvpool.ops.serve import run_master

    given = {f.name: getattr(args, f.name) for f in MASTER_FLAGS}
    config = MasterConfig.from_flags({n: v for n, v in given.items() if v is not None})
    return run_master(config, log_level=args.log_level)


def _add_node(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "node",
        help="contribute this host's memory to the pool (config: KVPOOL_CONFIG_PATH)",
        description="Reads mooncake.json-style config from --config, KVPOOL_CONFIG_PATH or "
        "MOONCAKE_CONFIG_PATH; registers with its metadata_server and serves its segment.",
    )
    p.add_argument("--config", help="node config file (default: from the environment)")
    add_flag(p, "data_port", type=int, default=0, help="data server port (default: any free)")
    add_flag(p, "bind", default="", help="data server bind address (default: local_hostname)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without a credential (default: refuse; docs/security.md)",
    )
    add_flag(p, "log_level", help="debug, info (default), warning")
    p.set_defaults(run=_run_node, command_name=p.prog)


def _run_node(args: argparse.Namespace) -> int:
    from kvpool.ops.serve import NodeOptions, run_node

    return run_node(
        NodeOptions(
            config=args.config,
            data_port=args.data_port,
            bind=args.bind,
            log_level=args.log_level,
            insecure=args.insecure,
        )
    )


def _add_doctor(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="check a node or a P/D pair against the production guide's §8.3 table and"
        " §9 checklist",
        description="One line per check (PASS/WARN/FAIL/SKIP) with the exact fix; exit 1 on FAIL.",
    )
    p.add_argument(
        "--config", help="node config file (default: KVPOOL_CONFIG_PATH, MOONCAKE_CONFIG_PATH)"
    )
    p.add_argument(
        "--kv-transfer-config",
        help="this node's --kv-transfer-config: JSON, a file, or a whole vLLM command line",
    )
    p.add_argument("--vllm-cmd", help='this node\'s "vllm serve ... --kv-transfer-config ..." line')
    p.add_argument("--prefill-config", help="the prefill side's config (JSON, file or command)")
    p.add_argument("--decode-config", help="the decode side's config (JSON, file or command)")
    p.add_argument("--model", help="the model directory (its config.json decides MLA)")
    p.add_argument("--master", metavar="HOST:PORT", help="the master (default: from the config)")
    p.add_argument(
        "--master-cmd", help='the master\'s command line, e.g. "kvpool master --port ..."'
    )
    p.add_argument(
        "--prefill-host", help="connect to the prefill kv_port there (the guide's nc -zv)"
    )
    p.add_argument(
        "--live", action="store_true", help="the instances are running: ports must be held"
    )
    p.add_argument(
        "--separate-hosts",
        action="store_true",
        help="--prefill-config/--decode-config run on other hosts (skip same-host port checks)",
    )
    p.add_argument("--no-key-probe", action="store_true", help="skip the block-key subprocesses")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_run_doctor, command_name=p.prog)


def _run_doctor(args: argparse.Namespace) -> int:
    from kvpool.ops import doctor

    options = doctor.DoctorOptions(
        config=args.config,
        kv_transfer_config=args.kv_transfer_config,
        vllm_cmd=args.vllm_cmd,
        prefill_config=args.prefill_config,
        decode_config=args.decode_config,
        model=args.model,
        master=args.master,
        master_cmd=args.master_cmd,
        prefill_host=args.prefill_host,
        live=args.live,
        separate_hosts=args.separate_hosts,
        probe_keys=not args.no_key_probe,
        as_json=args.json,
    )
    return doctor.run(options)


def _add_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="render or check node configs")
    actions = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    render = actions.add_parser(
        "render", help="per-node mooncake.json, --kv-transfer-config and commands from an inventory"
    )
    render.add_argument(
        "inventory", help="inventory file (.toml or .json; see docs/configuration.md)"
    )
    render.add_argument("--out", required=True, help="output directory (one folder per host)")
    add_flag(
        render, "engine", choices=("kvpool", "mooncake"),
        help="the pool the files are for (default: the inventory's engine, else kvpool)",
    )  # fmt: skip
    render.add_argument(
        "--new-secret",
        action="store_true",
        help="replace the cluster secret already in --out (a rotation: docs/security.md)",
    )
    render.set_defaults(run=_run_config_render, command_name=render.prog)
    check = actions.add_parser("check", help="validate a node config file and print it resolved")
    check.add_argument("path", nargs="?", help="default: KVPOOL_CONFIG_PATH, MOONCAKE_CONFIG_PATH")
    check.set_defaults(run=_run_config_check, command_name=check.prog)


def _run_config_render(args: argparse.Namespace) -> int:
    from kvpool.ops import render

    return render.run(
        render.RenderOptions(
            inventory=args.inventory, out=args.out, engine=args.engine, new_secret=args.new_secret
        )
    )


def _run_config_check(args: argparse.Namespace) -> int:
    from kvpool.ops import render

    return render.run_check(render.CheckOptions(path=args.path))


def _add_running_master(p: argparse.ArgumentParser) -> None:
    """``--master``: the running master a command reads (status, quota)."""
    p.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="the master (default: the node config's metadata_server, else"
        f" 127.0.0.1:{DEFAULT_MASTER_PORT})",
    )


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="the pool at a glance: tiers, objects, clients, hit ratios, evictions, errors",
        description="Reads the master's /api/status and /metrics over HTTP; exit 1 when the "
        "master cannot be read.  The same facts, with charts, are at http://MASTER/status.",
    )
    _add_running_master(p)
    p.add_argument(
        "--watch",
        metavar="SECONDS",
        nargs="?",
        const=2.0,
        type=float,
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (one line each)")
    p.set_defaults(run=_run_status, command_name=p.prog)


def _run_status(args: argparse.Namespace) -> int:
    from kvpool.ops import status

    options = status.StatusOptions(master=args.master, watch_s=args.watch, as_json=args.json)
    return status.run(options)


def _add_secret(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "secret",
        help="make a cluster secret; print the operator's token, a node's or a tenant's credential",
        description="new: a fresh secret; token: the bearer token of the master's HTTP "
        "endpoints; node-key --node-id ID: node ID's own credential; tenant-key --tenant "
        "NAME: tenant NAME's credential.  The secret is read "
        "from --secret-file, else KVPOOL_SECRET_FILE, else KVPOOL_SECRET.",
    )
    p.add_argument("action", choices=["new", "token", "node-key", "tenant-key"])
    add_flag(p, "secret_file", default="", help="file with the cluster secret")
    add_flag(p, "node_id", default="", help="the node of node-key (node-<name>)")
    add_flag(p, "tenant", default="", help="the tenant of tenant-key")
    p.set_defaults(run=_run_secret, command_name=p.prog)


def _run_secret(args: argparse.Namespace) -> int:
    from kvpool.ops import secret

    opts = secret.SecretOptions(args.action, args.secret_file, args.node_id, args.tenant)
    return secret.run(opts)


def _add_quota(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "quota",
        help="set a tenant's byte quota on a running master, or show every tenant's",
        description="set TENANT SIZE: the tenant may hold at most SIZE (8GB, 512MiB; 0: no "
        "quota), sent with the cluster secret.  show [TENANT]: each tenant's quota, bytes "
        "held, objects, hits, misses, evictions and refused puts, from the master's "
        "/metrics.  The secret is read from --secret-file, else KVPOOL_SECRET_FILE, else "
        "KVPOOL_SECRET.",
    )
    p.add_argument("action", choices=["set", "show"])
    p.add_argument("tenant", nargs="?", default="", metavar="TENANT")
    p.add_argument("size", nargs="?", default="", metavar="SIZE")
    _add_running_master(p)
    add_flag(p, "secret_file", default="", help="file with the cluster secret")
    p.add_argument("--json", action="store_true", help="machine-readable output (one line each)")
    p.set_defaults(run=_run_quota, command_name=p.prog)


def _run_quota(args: argparse.Namespace) -> int:
    from kvpool.ops import quota

    if args.action == "show" and args.size:
        raise ConfigError("kvpool quota show takes at most a TENANT (set takes TENANT SIZE)")
    options = quota.QuotaOptions(
        args.action, args.tenant, args.size, args.master, args.secret_file, args.json
    )
    return quota.run(options)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = args.run
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run(args)
    except ConfigError as exc:  # the one place a usage error becomes exit status 2
        print(f"{args.command_name}: {exc}", file=sys.stderr)
        return 2
