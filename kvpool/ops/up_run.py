"""``kvpool up``'s edge: files, ports, the tiny model, signals, the console, the main loop.

Startup → serve → shutdown, uvicorn style:

- startup: refuse a state directory another live ``kvpool up`` holds, check every port is
  free (a clear error naming the flag instead of a child dying later), write
  ``mooncake.json`` (and the chat template), build the tiny model unless ``--model``, then
  start the plan's stages in order, each one healthy before the next;
- serve: print the endpoints and commands, then watch: a vLLM instance that dies is
  reported and the rest keeps serving (the proxy takes it out of rotation); the master or
  the proxy dying ends the stack;
- shutdown (Ctrl-C, SIGTERM, SIGHUP, a failed start): every process group is stopped,
  proxy first, master last, SIGTERM then SIGKILL, and ``up.json`` is removed.

``<state>/up.json`` says what runs (pids, URLs, logs) while ``kvpool up`` is alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from kvpool.errors import ConfigError
from kvpool.ops.up import UpOptions, UpPlan, make_plan, ready_text
from kvpool.ops.up_procs import Running, StartupFailed, Supervisor, describe_exit, log_tail

__all__ = [
    "STATE_FILE",
    "default_state_dir",
    "options_from_args",
    "resolve_ports",
    "run_cli",
    "run_up",
]

STATE_FILE = "up.json"
_PORT_FIELDS = (
    ("master_port", "--master-port"),
    ("proxy_port", "--proxy-port"),
    ("prefill_port", "--prefill-port"),
    ("decode_port", "--decode-port"),
    ("prefill_kv_port", "--prefill-kv-port"),
    ("decode_kv_port", "--decode-kv-port"),
)


def default_state_dir(env: Mapping[str, str]) -> Path:
    """``$KVPOOL_STATE_DIR``, else ``$XDG_STATE_HOME/kvpool/up``, else ``./.kvpool-state``."""
    if env.get("KVPOOL_STATE_DIR"):
        return Path(env["KVPOOL_STATE_DIR"])
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "kvpool" / "up"
    return Path(".kvpool-state")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def resolve_ports(opts: UpOptions, zero: Mapping[str, bool]) -> UpOptions:
    """Give every port flag that was ``0`` a free port (``zero`` names those fields)."""
    changes: dict[str, Any] = {n: _free_port(opts.host) for n, is_zero in zero.items() if is_zero}
    return replace(opts, **changes) if changes else opts


def _check_ports(plan: UpPlan) -> None:
    opts = plan.options
    wanted: list[tuple[int, str]] = [(opts.master_port, "--master-port")]
    if not opts.no_vllm:
        wanted.append((opts.proxy_port, "--proxy-port"))
        for role in ("prefill", "decode"):
            n = opts.prefill_instances if role == "prefill" else opts.decode_instances
            http = opts.prefill_port if role == "prefill" else opts.decode_port
            kv = opts.prefill_kv_port if role == "prefill" else opts.decode_kv_port
            wanted += [(http + i, f"--{role}-port") for i in range(n)]
            wanted += [(kv + i, f"--{role}-kv-port") for i in range(n)]
    for port, flag in wanted:
        if not _port_free(opts.host, port):
            raise ConfigError(
                f"{flag}: {opts.host}:{port} is already in use (another kvpool up?);"
                f" stop what holds it or choose another port with {flag} (0: any free port)"
            )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim_state_dir(state: Path) -> None:
    path = state / STATE_FILE
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    pid = previous.get("pid") if isinstance(previous, dict) else None
    if isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
        raise ConfigError(
            f"--state-dir: {state} is in use by another kvpool up (pid {pid});"
            " stop it (Ctrl-C or kill -TERM) or pick another --state-dir"
        )
    # left by a kvpool up that was killed: it describes nothing that runs
    path.unlink(missing_ok=True)


def _write_state(plan: UpPlan, sup: Supervisor, status: str) -> None:
    state: dict[str, Any] = {
        "pid": os.getpid(),
        "status": status,
        "model": str(plan.model_dir),
        "model_name": plan.model_name,
        "master": plan.master_url,
        "proxy": plan.proxy_url,
        "node_config": str(plan.node_config_path),
        "processes": {
            r.spec.name: {
                "pid": r.pid,
                "role": r.spec.role,
                "url": r.spec.url,
                "log": str(r.spec.log_path),
                "alive": r.proc.poll() is None,
            }
            for r in sup.running
        },
    }
    path = plan.options.state_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def _check_vllm(plan: UpPlan) -> None:
    if plan.options.no_vllm or plan.options.python != sys.executable:
        return  # another interpreter: its own failure will be shown with its log
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "vLLM is not installed in this environment; run scripts/setup.sh (without"
            " --no-vllm), or start the pool alone with kvpool up --no-vllm"
        )


def _prepare(plan: UpPlan, console: Console) -> None:
    _check_vllm(plan)
    for d in plan.dirs:
        d.mkdir(parents=True, exist_ok=True)
    for path, text in plan.files.items():
        path.write_text(text)
    if plan.build_model:
        _ensure_tiny_model(plan.model_dir, console)
    elif not plan.options.no_vllm and not (plan.model_dir / "config.json").is_file():
        raise ConfigError(f"--model: {plan.model_dir} has no config.json; give a model directory")


def _ensure_tiny_model(model_dir: Path, console: Console) -> None:
    if (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file():
        return
    from kvpool.testing.tiny_model import build_tiny_model

    with console.status(f"building a small model in {model_dir} (no hub access needed)"):
        tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
        build_tiny_model(tmp)
        if model_dir.exists():  # a half-built directory from an interrupted run
            import shutil

            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    console.print(f"[green]✓[/] built a small Llama model in {model_dir}")


class _StopFlag:
    """Set by SIGINT/SIGTERM/SIGHUP; the main loop polls it (no work in the handler)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum

    def __bool__(self) -> bool:
        return self.signal is not None


@contextlib.contextmanager
def _handle_signals(flag: _StopFlag) -> Iterator[None]:
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, flag) for s in sigs}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_up(
    opts: UpOptions,
    *,
    start_timeout_s: float = 300.0,
    stop_timeout_s: float = 20.0,
    console: Console | None = None,
) -> int:
    """Bring the stack up, serve until a signal, stop everything.  Returns the exit status:
    0 after a requested stop, 1 when something failed, 2 for a usage error."""
    console = console or Console(highlight=False, soft_wrap=True)
    try:
        plan = make_plan(opts)
        _claim_state_dir(opts.state_dir)
        _check_ports(plan)
        _prepare(plan, console)
    except ConfigError as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 2
    stop = _StopFlag()
    sup = Supervisor(base_env=dict(os.environ), term_timeout_s=stop_timeout_s)
    status = 0
    with _handle_signals(stop):
        try:
            status = _start_and_serve(plan, sup, stop, start_timeout_s, console)
        finally:
            _shutdown(plan, sup, console)
    return status


def _start_and_serve(
    plan: UpPlan, sup: Supervisor, stop: _StopFlag, timeout_s: float, console: Console
) -> int:
    def healthy(r: Running) -> None:
        console.print(
            f"[green]✓[/] {r.spec.name:<10} healthy in {r.healthy_after_s:5.1f} s  {r.spec.url}"
        )

    try:
        for stage in plan.stages:
            running = [sup.start(spec) for spec in stage]
            _write_state(plan, sup, "starting")
            names = ", ".join(r.spec.name for r in running)
            with console.status(f"starting {names}") as shown:

                def waiting(pending: list[Running], elapsed: float) -> None:
                    left = ", ".join(r.spec.name for r in pending)
                    shown.update(f"waiting for {left} ({elapsed:.0f} s of {timeout_s:.0f} s)")

                if not sup.wait_healthy(
                    running, timeout_s, should_stop=lambda: bool(stop), on_healthy=healthy,
                    on_wait=waiting,
                ):  # fmt: skip
                    console.print("kvpool up: stop requested while starting")
                    return 0
    except StartupFailed as exc:
        console.print(f"[red]✗ {exc.name} failed to start:[/] {exc.reason}")
        console.print(f"last lines of {exc.log_path}:", markup=False)
        console.print(log_tail(exc.log_path), markup=False, highlight=False, soft_wrap=True)
        return 1
    _write_state(plan, sup, "ready")
    _print_ready(plan, console)
    return _serve(plan, sup, stop, console)


def _print_ready(plan: UpPlan, console: Console) -> None:
    console.print("[bold green]kvpool up: ready[/] (Ctrl-C stops everything)")
    for label, text in ready_text(plan):
        console.print(f"  {label + ':':<15}", end="")
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def _serve(plan: UpPlan, sup: Supervisor, stop: _StopFlag, console: Console) -> int:
    while not stop:
        for r in sup.exited():
            code = r.proc.returncode
            assert code is not None
            console.print(
                f"[red]✗ {r.spec.name} exited ({describe_exit(code)})[/]; last lines of"
                f" {r.spec.log_path}:"
            )
            console.print(log_tail(r.spec.log_path, 15), markup=False, soft_wrap=True)
            # A dead API server can leave its engine processes behind, decoding for nobody
            # and holding memory: stop what is left of its group.
            console.print(f"  {r.spec.name:<10} rest of its process group {sup.stop(r)}")
            _write_state(plan, sup, "degraded")
            if r.spec.role in ("master", "proxy"):
                console.print(f"kvpool up: the {r.spec.role} is gone; stopping the stack")
                return 1
            console.print(
                f"kvpool up: {r.spec.name} is out; the proxy serves with the other instances"
            )
        time.sleep(0.25)
    return 0


def _shutdown(plan: UpPlan, sup: Supervisor, console: Console) -> None:
    if sup.running:
        console.print("kvpool up: stopping (proxy, vLLM instances, then the master)")

    def stopped(r: Running, how: str) -> None:
        console.print(f"  {r.spec.name:<10} {how}")

    sup.stop_all(stopped)
    with contextlib.suppress(FileNotFoundError):
        (plan.options.state_dir / STATE_FILE).unlink()


def _parse_cpus(text: str) -> tuple[int, ...]:
    """``0,1`` or ``0-3`` or ``0-1,4``."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            cores += range(int(lo), int(hi) + 1) if dash else [int(lo)]
    except ValueError:
        raise ConfigError(f"--cpus: expected core numbers like 0,1 or 0-3, got {text!r}") from None
    return tuple(cores)


def options_from_args(
    args: Any, env: Mapping[str, str], usable_cpus: tuple[int, ...], python: str
) -> tuple[UpOptions, dict[str, bool]]:
    """``kvpool up``'s parsed flags → options, plus which port flags asked for any free
    port (0), which the caller resolves with :func:`resolve_ports`."""
    import shlex

    from kvpool.config import parse_size

    zero = {name: getattr(args, name) == 0 for name, _ in _PORT_FIELDS}
    # 0 (any free port) is resolved later; 1 holds its place so the options validate
    ports: dict[str, Any] = {name: getattr(args, name) or 1 for name, _ in _PORT_FIELDS}
    try:
        vllm_args = tuple(shlex.split(args.vllm_args or ""))
    except ValueError as exc:
        raise ConfigError(f"--vllm-args: {exc}") from None
    opts = UpOptions(
        # absolute, so the printed paths (KVPOOL_CONFIG_PATH=...) work from any directory
        state_dir=(Path(args.state_dir) if args.state_dir else default_state_dir(env)).absolute(),
        model=Path(args.model).expanduser().absolute() if args.model else None,
        no_vllm=args.no_vllm,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        segment_size=parse_size(args.segment_size, key="--segment-size"),
        ssd_limit=parse_size(args.ssd_limit, key="--ssd-limit"),
        kv_cache_bytes=parse_size(args.kv_cache_bytes, key="--kv-cache-bytes"),
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        served_model_name=args.served_model_name,
        policy=args.policy,
        cpus=_parse_cpus(args.cpus) if args.cpus else usable_cpus,
        vllm_args=vllm_args,
        python=python,
        **ports,
    )
    return opts, zero


def run_cli(args: Any) -> int:
    """``kvpool up`` from parsed flags (the CLI's thin ``run=``)."""
    console = Console(highlight=False, soft_wrap=True)
    try:
        usable = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        usable = tuple(range(os.cpu_count() or 1))
    try:
        opts, zero = options_from_args(args, os.environ, usable, sys.executable)
        opts = resolve_ports(opts, zero)
    except ConfigError as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 2
    return run_up(
        opts,
        start_timeout_s=args.start_timeout,
        stop_timeout_s=args.stop_timeout,
        console=console,
    )
