"""Time without a master, and what a failover loses: HA masters against one master.

Per round, on 127.0.0.1: a real etcd, two ``kvpool master --enable_ha`` (no memory of
their own), one ``kvpool node`` holding the pool, and three client threads putting and
reading 8 KiB values (each read checks its bytes).  Then the leader is stopped, by
SIGKILL (a crash: its lease runs out) or SIGTERM (it resigns), and started again as a
standby.  The baseline, in the same run: one master without HA, SIGKILLed and started
again at once on its port (what a supervisor does, when the host survives).  Measured
per round: the time from the fault to the first operation that started after it and
succeeded; acknowledged puts lost (read back after the round); reads with wrong bytes.

    python bench/failover.py [--rounds 5] [--ttl 3] [--markdown]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool.client.client import Client
from kvpool.errors import KVPoolError, ObjectNotFound
from kvpool.testing.etcd import EtcdCluster, free_port
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node

SIZE = 8192
CLIENTS = 3


def value_of(key: str) -> bytes:
    return (key.encode() * (SIZE // len(key) + 1))[:SIZE]


@dataclass
class Load:
    """Client threads putting fresh keys and reading earlier ones until stopped."""

    spec: str
    tag: str
    acked: list[str] = field(default_factory=list)
    done: list[tuple[float, float, bool]] = field(default_factory=list)  # start, end, ok
    wrong: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, i: int) -> None:
        with Client(self.spec, allow_shm=False, timeout_s=5.0) as client:
            n = 0
            while not self.stop.is_set() and n < 20_000:
                key = f"{self.tag}-{i}-{n}"
                started = time.monotonic()
                try:
                    client.put(key, value_of(key))
                    self.acked.append(key)
                    ok = True
                    if n >= 2:
                        old = f"{self.tag}-{i}-{n - 2}"
                        if client.get(old) != value_of(old):
                            self.wrong += 1
                except KVPoolError:
                    ok = False
                self.done.append((started, time.monotonic(), ok))
                n += 1
                self.stop.wait(0.01)

    def first_success_after(self, t: float) -> float:
        return min(end for start, end, ok in self.done if start >= t and ok) - t


def check(spec: str, keys: list[str]) -> tuple[int, int]:
    """(acknowledged puts missing, reads with wrong bytes) after the round."""
    lost = wrong = 0
    with Client(spec, allow_shm=False, timeout_s=5.0) as client:
        for key in keys:
            try:
                wrong += client.get(key) != value_of(key)
            except ObjectNotFound:
                lost += 1
    return lost, wrong


def round_trip(spec: str, tag: str, fault: object) -> tuple[float, int, int]:
    load = Load(spec, tag)
    threads = [threading.Thread(target=load.run, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    t_fault = time.monotonic()
    fault()  # type: ignore[operator]
    time.sleep(0.5)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(start >= t_fault and ok for start, _, ok in list(load.done)):
            break
        time.sleep(0.05)
    time.sleep(1.0)
    load.stop.set()
    for t in threads:
        t.join(60)
    lost, wrong = check(spec, load.acked)
    return load.first_success_after(t_fault), lost, wrong + load.wrong


def ha_rounds(rounds: int, ttl: int, sig: int, work: Path) -> list[tuple[float, int, int]]:
    with EtcdCluster(work / f"etcd-{sig}") as etcd:
        ports = [free_port(), free_port()]
        argv = ["--segment_size", "0", "--enable_ha", "--etcd_endpoints", etcd.endpoints,
                "--ha_lease_ttl", str(ttl)]  # fmt: skip
        masters = [start_master("--port", str(p), *argv) for p in ports]
        spec = ",".join(m.address for m in masters)
        node = start_node(node_config(work, spec, "256MiB"))
        out = []
        try:
            time.sleep(1.0)
            for r in range(rounds):
                leader = next(m for m in masters if leads(m))

                def fault(leader: PoolProcess = leader) -> None:
                    leader.proc.send_signal(sig)

                out.append(round_trip(spec, f"ha{sig}-{r}", fault))
                leader.stop()
                i = masters.index(leader)
                masters[i] = start_master("--port", str(ports[i]), *argv)  # back as a standby
                time.sleep(1.0)
        finally:
            node.stop()
            for m in masters:
                m.stop()
    return out


def leads(master: PoolProcess) -> bool:
    from kvpool.protocol import messages as m

    with Client(master.address) as c:
        who = c.link.call(m.WhoLeads())
    return isinstance(who, m.LeaderInfo) and who.role == "leader"


def single_rounds(rounds: int, work: Path) -> list[tuple[float, int, int]]:
    port = free_port()
    argv = ["--port", str(port), "--segment_size", "0"]
    master = [start_master(*argv)]
    spec = master[0].address
    node = start_node(node_config(work, spec, "256MiB"))
    out = []
    try:
        time.sleep(1.0)
        for r in range(rounds):

            def fault() -> None:
                master[0].kill()
                master[0] = start_master(*argv)  # a supervisor restarts it at once

            out.append(round_trip(spec, f"single-{r}", fault))
    finally:
        node.stop()
        master[0].stop()
    return out


def summary(name: str, rows: list[tuple[float, int, int]], base: float) -> str:
    gaps = [g for g, _, _ in rows]
    p50 = statistics.median(gaps)
    return (
        f"| {name} | {p50:.2f} | {max(gaps):.2f} | {p50 / base:.2f}× |"
        f" {sum(lost for _, lost, _ in rows)} | {sum(w for _, _, w in rows)} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ttl", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "s").mkdir()
        (work / "k").mkdir()
        (work / "t").mkdir()
        single = single_rounds(args.rounds, work / "s")
        killed = ha_rounds(args.rounds, args.ttl, signal.SIGKILL, work / "k")
        stopped = ha_rounds(args.rounds, args.ttl, signal.SIGTERM, work / "t")
    base = statistics.median(g for g, _, _ in single)
    print(f"rounds {args.rounds}, lease TTL {args.ttl} s, {CLIENTS} client threads, 8 KiB values")
    print(
        "| fault | no master p50 (s) | max (s) | p50 / one master restarted"
        " | acked puts lost | wrong bytes |"
    )
    print("|---|---|---|---|---|---|")
    print(summary("one master, SIGKILL, restarted at once (baseline)", single, base))
    print(summary("HA leader SIGKILLed (lease runs out)", killed, base))
    print(summary("HA leader SIGTERMed (resigns)", stopped, base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
