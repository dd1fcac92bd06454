"""``kvpool up``'s edge: files, ports, the tiny model, signals, the console, the main loop.

Startup → serve → shutdown, uvicorn style (each step is written above :func:`run`).
``<state>/up.json`` says what runs (pids, URLs, logs) while ``kvpool up`` is alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from kvpool.config.vllm_versions import check_vllm_version, installed_vllm_version
from kvpool.errors import ConfigError
from kvpool.mooncake.up import EVERY_INTERFACE
from kvpool.mooncake.wheel import master_binary
from kvpool.net import free_port_runs, port_free
from kvpool.ops.up.options import HA_PORTS, PORT_FLAGS, UpOptions
from kvpool.ops.up.plan import UpPlan, make_plan, planned_ports, ready_text
from kvpool.ops.up.supervisor import Running, StartupFailed, Supervisor, describe_exit, log_tail
from kvpool.storage.segment import pid_alive

__all__ = ["STATE_FILE", "resolve_ports", "run", "usable_cpus"]

STATE_FILE = "up.json"


def usable_cpus() -> tuple[int, ...]:
    """The cores this process may run on (the vLLM instances share them by default)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def _run_length(opts: UpOptions, name: str) -> int:
    """How many consecutive ports the flag ``name`` stands for: one per instance (HTTP),
    one per rank of every instance (kv ports)."""
    for role in ("prefill", "decode"):
        instances = int(getattr(opts, f"{role}_instances"))
        if name == f"{role}_port":
            return instances
        if name == f"{role}_kv_port":
            return instances * int(opts.layout(role).ranks)
    return 2 if name == "etcd_port" else 1  # etcd's client port, then its peer port


def resolve_ports(opts: UpOptions) -> UpOptions:
    """Give every port that is ``0`` (any free port) the first of as many consecutive
    free ports as it stands for (a port free on its own once let the second decode
    instance's kv port land on a taken one)."""
    names = [
        name
        for name, _, _ in PORT_FLAGS
        if getattr(opts, name) == 0 and (opts.ha or name not in HA_PORTS)
    ]
    if not names:
        return opts
    try:
        bases = free_port_runs(opts.host, [_run_length(opts, name) for name in names])
    except OSError as exc:
        raise ConfigError(f"port 0 (any free port): {exc}; name the ports instead") from None
    ports: dict[str, Any] = dict(zip(names, bases, strict=True))
    return replace(opts, **ports)


def _check_ports(plan: UpPlan) -> None:
    """A taken port is refused before anything starts, naming its flag, instead of a
    child dying later with "address already in use" in its log."""
    host = plan.options.host
    for use in planned_ports(plan.options):
        if not port_free(host, use.port):
            raise ConfigError(
                f"{use.flag}: {host}:{use.port} is already in use (another kvpool up?);"
                f" stop what holds it or choose another port with {use.flag} (0: any free port)"
            )


def _claim_state_dir(state: Path) -> None:
    path = state / STATE_FILE
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    pid = previous.get("pid") if isinstance(previous, dict) else None
    if isinstance(pid, int) and pid != os.getpid() and pid_alive(pid):
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
    # the connectors would refuse it inside vLLM's engine; say it here, before any start
    check_vllm_version(installed_vllm_version())


def _prepare(plan: UpPlan, console: Console) -> None:
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
    from kvpool.ops.up.tiny_model import build_tiny_model

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


# - startup: with ``--engine mooncake``, find the wheel's ``mooncake_master`` (a missing
#   wheel is one line with the install command) and say that Mooncake's ports listen on
#   every interface; refuse a state directory another live ``kvpool up`` holds, check every port is
#   free (a clear error naming the flag instead of a child dying later), write
#   ``mooncake.json`` (and the chat template), build the tiny model unless ``--model``, then
#   start the plan's stages in order, each one healthy before the next;
# - serve: print the endpoints and commands, then watch: a vLLM instance that dies is
#   reported and the rest keeps serving (the proxy takes it out of rotation); the master or
#   the proxy dying ends the stack;
# - shutdown (Ctrl-C, SIGTERM, SIGHUP, a failed start): every process group is stopped,
#   proxy first, master last (SIGTERM to the process, then its group, then SIGKILL),
#   and ``up.json`` is removed.
def run(opts: UpOptions, *, console: Console | None = None) -> int:
    """``kvpool up``: bring the stack up, serve until a signal, stop everything.

    Returns 0 after a requested stop and 1 when something failed; a usage error found
    before anything starts (a taken port, a busy state directory) is a ConfigError.
    """
    console = console or Console(highlight=False, soft_wrap=True)
    if opts.engine == "mooncake":
        opts = replace(opts, mooncake_master=master_binary())
    opts = resolve_ports(opts)
    plan = make_plan(opts)
    _check_vllm(plan)  # what no port or folder can fix is said first
    _claim_state_dir(opts.state_dir)
    _check_ports(plan)
    _prepare(plan, console)
    if opts.engine == "mooncake":
        console.print(f"[yellow]![/] {EVERY_INTERFACE.format(host=opts.host)}")
    stop = _StopFlag()
    sup = Supervisor(base_env=dict(os.environ), term_timeout_s=opts.stop_timeout_s)
    status = 0
    with _handle_signals(stop):
        try:
            status = _start_and_serve(plan, sup, stop, opts.start_timeout_s, console)
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
    for label, text in ready_text(plan, os.environ):
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
            if r.spec.role == "master" and plan.options.ha:
                # an HA master that died or stopped leading comes back as a standby
                again = sup.start(r.spec)
                sup.running.remove(r)
                console.print(f"kvpool up: {r.spec.name} restarted as a standby (pid {again.pid})")
                _write_state(plan, sup, "ready")
                continue
            _write_state(plan, sup, "degraded")
            if r.spec.role in ("master", "proxy", "etcd", "node"):
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
