"""Run one command beside a real ``mooncake_master``, both inside a private network namespace.

Mooncake's listeners bind every interface, so a benchmark row on Mooncake runs its whole
vLLM process in a namespace of its own, next to its own master:

    argv = _netns.command([python, "bench/ttft.py", "--child", spec], workdir)

:func:`command` wraps ``argv`` in ``unshare --net --pid --mount-proc --fork --kill-child``
around this module.  Inside, this module brings ``lo`` up, starts ``mooncake_master`` on 127.0.0.1
(:class:`kvpool.testing.mooncake.MooncakeMaster`, which refuses to start outside a
private namespace), writes a Mooncake ``mooncake.json`` naming it (``MOONCAKE_CONFIG_PATH``,
read alike by kvpool's Mooncake engine and by vLLM's ``MooncakeStoreConnector``), runs
``argv`` and stops the master.

Why a PID namespace too: this module is the namespace's init.  When it ends — normally,
or killed because the caller's timeout ran out (``--kill-child`` passes unshare's death
on) — the kernel ends every process left in the namespace, the master and vLLM included,
so nothing outlives the row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["MASTER_RPC", "command", "mooncake_json"]

MASTER_RPC = "127.0.0.1:50051"
# Lease as the production guide sets it (above the 10 s transfer timeout).
MASTER_FLAGS = ("--default_kv_lease_ttl=11000",)

# kvpool.testing.mooncake.private_netns compares its namespace with the one named here
# (a container may not let it read init's /proc/1/ns/net).
_HOST_NETNS_VAR = "KVPOOL_HOST_NETNS"


def mooncake_json(segment: int) -> dict[str, object]:
    """A Mooncake node config for a vLLM process that contributes ``segment`` bytes to the
    pool: only keys both kvpool's and vLLM's Mooncake readers take."""
    return {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": MASTER_RPC,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": segment,
        "local_buffer_size": 64 << 20,
    }


def command(argv: list[str], workdir: Path, *, segment: int = 1 << 30) -> list[str]:
    """``argv`` as a command that runs it in a fresh namespace beside its own master."""
    return [
        # --mount-proc: a /proc of this PID namespace.  Without it /proc is the host's, so
        # /proc/<our pid> is another process or none: vLLM's CPU worker reads
        # /proc/{getpid()}/status for its memory affinity and died with FileNotFoundError
        # whenever the host had no process of that low PID (which depended on what ran before)
        "unshare", "--net", "--pid", "--mount-proc", "--fork", "--kill-child",
        sys.executable, str(Path(__file__).resolve()),
        "--workdir", str(workdir), "--segment", str(segment), "--", *argv,
    ]  # fmt: skip


def host_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus the caller's namespace, for the check that the master's is another."""
    return {**env, _HOST_NETNS_VAR: str(os.stat("/proc/self/ns/net").st_ino)}


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--segment", type=int, required=True)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

    from kvpool.testing.mooncake import MooncakeMaster

    args.workdir.mkdir(parents=True, exist_ok=True)
    config = args.workdir / "mooncake.json"
    config.write_text(json.dumps(mooncake_json(args.segment)))
    master = MooncakeMaster(*MASTER_FLAGS, log_path=str(args.workdir / "mooncake_master.log"))
    try:
        env = {**os.environ, "MOONCAKE_CONFIG_PATH": str(config), "VLLM_HOST_IP": "127.0.0.1"}
        return subprocess.run(argv, env=env, check=False).returncode
    finally:
        master.stop()
        _end_the_rest()


def _end_the_rest(grace_s: float = 10.0) -> None:
    """As the namespace's init: SIGTERM what the row left running (so it cleans up),
    SIGKILL what is still there after ``grace_s``, then remove the kvpool segments of
    processes that died without closing them (their owners' locks are free now; the
    kernel would otherwise SIGKILL them at our exit and leave their /dev/shm files)."""
    if os.getpid() != 1:
        return
    from kvpool.storage.segment import remove_stale_segments

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, sig)  # from init: every other process of the namespace
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break  # none left
            if pid == 0:
                time.sleep(0.05)
        else:
            continue
        break
    remove_stale_segments()


if __name__ == "__main__":
    sys.exit(_main())
