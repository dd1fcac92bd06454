"""bench/_netns.py: a command run beside its own mooncake_master sees a /proc of its own
PID namespace, so ``/proc/<its pid>`` is itself (vLLM reads its own status there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench import _netns

ROOT = Path(__file__).resolve().parents[2]
# what vLLM's CPU worker does (vllm/utils/cpu_resource_utils.get_memory_affinity)
CHECK = """
import os
pid = os.getpid()
assert os.readlink("/proc/self") == str(pid), (os.readlink("/proc/self"), pid)
with open(f"/proc/{pid}/status") as status:
    assert f"Pid:\\t{pid}\\n" in status.read()
print("own proc", pid)
"""


def test_a_command_in_the_namespace_reads_its_own_proc_entry(tmp_path: Path) -> None:
    env = _netns.host_env({**os.environ, "PYTHONPATH": str(ROOT)})
    done = subprocess.run(
        _netns.command([sys.executable, "-c", CHECK], tmp_path, segment=16 << 20),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "own proc" in done.stdout
