"""``kvpool up`` as the vLLM tests drive it: started until its state file says ready, its
output read line by line, stopped with SIGTERM (then SIGKILL) on the way out; the
processes it started, found through /proc; JSON over HTTP; and the plain offline vLLM
engine (no connector) whose greedy answers a stack's must equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.ops.up.lifecycle import STATE_FILE
from kvpool.testing import lifetime
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 480.0  # three vLLM instances starting together on two shared cores
REQUEST_TIMEOUT_S = 120.0

_REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=2048,
              kv_cache_memory_bytes=64 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    texts = {p: llm.generate([p], params, use_tqdm=False)[0].outputs[0].text
             for p in spec["prompts"]}
    if "chat" in spec:
        chat = llm.chat(spec["chat"], params, use_tqdm=False, chat_template=spec["template"])
        texts["chat"] = chat[0].outputs[0].text
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    candidates = spec.get("split_candidates", [])
    firsts = llm.generate(candidates, one, use_tqdm=False) if candidates else []
    tok = llm.get_tokenizer()
    for prompt, out in zip(candidates, firsts):
        if tok.decode(out.outputs[0].token_ids).endswith("\ufffd"):
            texts["split"] = prompt
            texts[prompt] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
            break
    print("REFERENCE=" + json.dumps(texts))
"""


def offline_reference(spec: dict[str, Any]) -> dict[str, str]:
    """Greedy outputs of one plain offline vLLM engine, one prompt at a time, for
    ``spec``'s model, ``max_tokens`` and ``prompts``; with ``chat`` (and ``template``), the
    chat answer under ``"chat"``; with ``split_candidates``, the first of them whose first
    answer token ends inside a character under ``"split"``, and its answer."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REFERENCE=")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, str] = json.loads(lines[-1].removeprefix("REFERENCE="))
    return result


def _starttime(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat); None if it
    is gone or a zombie.  Comparing it guards against a reused PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid`` (children of all its threads, recursively)."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                start = _starttime(kid)
                if start is not None and kid not in found:
                    found[kid] = start
                    todo.append(kid)
    return found


def group_members(pgid: int) -> list[int]:
    """Running (not zombie) processes of a process group."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def still_alive(procs: dict[int, str]) -> list[int]:
    return [pid for pid, start in procs.items() if _starttime(pid) == start]


@dataclass
class Stack:
    proc: subprocess.Popen[str]
    state: Path
    info: dict[str, Any]
    lines: list[str] = field(default_factory=list)
    children: dict[int, str] = field(default_factory=dict)
    reader: threading.Thread | None = None  # appends kvpool up's output to lines

    @property
    def proxy(self) -> str:
        return str(self.info["proxy"])

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_output(self, text: str, timeout_s: float) -> None:
        """Until kvpool up has printed ``text`` (the output so far when it does not)."""
        try:
            wait_until(lambda: text in self.output(), timeout_s, interval_s=0.2, what=repr(text))
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.output()}") from None

    def read_to_end(self) -> str:
        """The whole output once kvpool up has exited: the reader ends at end of file."""
        if self.reader is not None:
            _join_reader(self.reader)
        return self.output()

    def pid(self, name: str) -> int:
        return int(self.info["processes"][name]["pid"])

    def log(self, name: str) -> str:
        return Path(self.info["processes"][name]["log"]).read_text(errors="replace")


def _read_lines(proc: subprocess.Popen[str], sink: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sink.append(line.rstrip("\n"))


def _join_reader(reader: threading.Thread) -> None:
    reader.join(30)
    assert not reader.is_alive(), "kvpool up exited but its output did not end"


def start_ready(
    argv: list[str], state: Path
) -> tuple[subprocess.Popen[str], list[str], threading.Thread, dict[str, Any]]:
    """``kvpool up`` started and ready: its process, its output so far, and its state.

    Port 0 gives free ports from the kernel's ephemeral range, where any outgoing
    connection of the other test worker may take one before vLLM binds it (seconds
    later): a start that died of exactly that is tried once more, on new ports."""
    for attempt in (1, 2):
        proc, lines, reader = start_up(argv)
        try:
            return proc, lines, reader, _wait_ready(proc, state, lines, reader)
        except AssertionError as exc:
            stop_up(proc, reader)
            busy = "already in use" in str(exc).lower()  # vLLM's, uvloop's, kvpool's words
            if attempt == 2 or proc.returncode is None or not busy:
                raise
    raise AssertionError("unreachable")


def stop_up(proc: subprocess.Popen[str], reader: threading.Thread) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(10)
    if proc.stdout is not None:
        proc.stdout.close()


def start_up(argv: list[str]) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    proc = lifetime.popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
    )
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(proc, lines), daemon=True)
    reader.start()
    return proc, lines, reader


def _wait_ready(
    proc: subprocess.Popen[str], state: Path, lines: list[str], reader: threading.Thread
) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        if proc.poll() is not None:
            _join_reader(reader)  # every last line, then say why
            raise AssertionError(f"kvpool up exited with {proc.returncode}")
        try:
            info: dict[str, Any] = json.loads((state / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return info if info.get("status") == "ready" else None

    try:
        return wait_until(ready, START_TIMEOUT_S + 60, interval_s=1, what="kvpool up ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n" + "\n".join(lines)) from None


@contextmanager
def running(argv: list[str], state: Path) -> Iterator[Stack]:
    """``kvpool up`` started and ready (:func:`start_ready`), stopped on the way out."""
    proc, lines, reader, info = start_ready(argv, state)
    try:
        yield Stack(proc, state, info, lines, reader=reader)
    finally:
        stop_up(proc, reader)


# --------------------------------------------------------------------------- HTTP


def get_json(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        result: dict[str, Any] = json.loads(reply.read())
        return result
