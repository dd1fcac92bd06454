"""One soak client process: mixed traffic on its own keys, every byte read checked.

``python -m tests.soak.traffic --master HOST:PORT --name c0 --transport shm --seconds 90
--max-ops 100000 --stop-file STOP --out result.json``

Values are self-describing: ``b"<key>|<version>|"`` then bytes derived from the key and
version, so a read proves which write it came from.  The client keeps, per key, the
versions a put acknowledged and the versions whose put failed in a way that may still have
stored them (a lost reply); a read must return a miss or exactly one of those for its key.
Keys are the client's own (they carry ``--name``), so no other process writes them; half
of them are shaped as Mooncake's and vllm-ascend's (``org/model@...@hash``), so they need a
safe file name in every SSD tier.

The loop stops when ``--stop-file`` exists (the soak says it has seen enough), and in any
case after ``--seconds`` or ``--max-ops``, whichever comes first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from kvpool.client.client import Client
from kvpool.errors import KVPoolError, ObjectNotFound

__all__ = ["Result", "main", "value_of"]

KEYS = 120
SIZES = (1024, 8 * 1024, 32 * 1024, 96 * 1024)
# errors after which the master may (or may not) have published the put
UNCERTAIN = {"PeerTimeout", "TransferError"}


def value_of(key: str, version: int, size: int) -> bytes:
    head = f"{key}|{version}|".encode()
    seed = hashlib.blake2b(head, digest_size=32).digest()
    body = (seed * (size // len(seed) + 1))[: max(0, size - len(head))]
    return head + body


@dataclass
class Result:
    ops: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    reads: int = 0
    misses: int = 0
    wrong: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)


class Traffic:
    def __init__(self, client: Client, name: str, rng: random.Random) -> None:
        self.client = client
        self.name = name
        self.rng = rng
        self.result = Result()
        self.version = 0
        self.valid: dict[str, set[int]] = {}

    def key(self) -> str:
        i = self.rng.randrange(KEYS)
        if i % 2:  # keys as Mooncake and vllm-ascend write them: '/' in a model's name
            return f"org/model@{self.name}@pcp0@dcp0@tp0@k{i}"
        return f"{self.name}-k{i}"

    def new_value(self, key: str) -> tuple[int, bytes]:
        self.version += 1
        return self.version, value_of(key, self.version, self.rng.choice(SIZES))

    def check(self, key: str, got: bytes | None) -> None:
        self.result.reads += 1
        if got is None:
            self.result.misses += 1
            return
        head, _, _ = got.partition(b"|")
        try:
            got_key = head.decode()
            version = int(got.split(b"|", 2)[1])
        except (UnicodeDecodeError, ValueError, IndexError):
            self.result.wrong.append(f"{key}: undecodable value of {len(got)} bytes")
            return
        if got_key != key or version not in self.valid.get(key, set()):
            self.result.wrong.append(f"{key}: got {got_key} version {version}")
        elif got != value_of(key, version, len(got)):
            self.result.wrong.append(f"{key}: version {version} with wrong bytes")

    def put(self) -> None:
        key = self.key()
        version, value = self.new_value(key)
        try:
            self.client.put(key, value)
        except KVPoolError as exc:
            self.failed(key, version, exc)
            return
        self.valid.setdefault(key, set()).add(version)

    def failed(self, key: str, version: int, exc: KVPoolError) -> None:
        name = type(exc).__name__
        self.result.errors[name] += 1
        if name in UNCERTAIN:
            self.valid.setdefault(key, set()).add(version)

    def batch_put(self) -> None:
        keys = sorted({self.key() for _ in range(self.rng.randint(2, 6))})
        made = [self.new_value(k) for k in keys]
        try:
            results = self.client.batch_put(keys, [v for _, v in made])
        except KVPoolError as exc:
            for key, (version, _) in zip(keys, made, strict=True):
                self.failed(key, version, exc)
            return
        for key, (version, _), error in zip(keys, made, results, strict=True):
            if error is None:
                self.valid.setdefault(key, set()).add(version)
            else:
                self.failed(key, version, error)

    def get(self) -> None:
        key = self.key()
        try:
            got: bytes | None = self.client.get(key)
        except ObjectNotFound:
            got = None
        except KVPoolError as exc:
            self.result.errors[type(exc).__name__] += 1
            return
        self.check(key, got)

    def batch_get(self) -> None:
        keys = sorted({self.key() for _ in range(self.rng.randint(2, 6))})
        try:
            values = self.client.batch_get(keys)
        except KVPoolError as exc:
            self.result.errors[type(exc).__name__] += 1
            return
        for key, got in zip(keys, values, strict=True):
            self.check(key, got)

    def exists(self) -> None:
        try:
            self.client.batch_exists([self.key() for _ in range(4)])
            self.client.exists(self.key())
        except KVPoolError as exc:
            self.result.errors[type(exc).__name__] += 1

    def remove(self) -> None:
        try:
            self.client.remove(self.key())
        except KVPoolError as exc:
            self.result.errors[type(exc).__name__] += 1

    def step(self) -> None:
        op = self.rng.choices(
            ["put", "batch_put", "get", "batch_get", "exists", "remove"],
            weights=[30, 10, 30, 10, 12, 8],
        )[0]
        self.result.ops[op] += 1
        try:
            getattr(self, op)()
        except Exception:  # anything outside the error hierarchy is a client bug
            self.result.crashes.append(traceback.format_exc(limit=8))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--transport", choices=["shm", "tcp"], required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--max-ops", type=int, required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rng = random.Random(args.name)
    with Client(args.master, timeout_s=5, transport=args.transport) as client:
        traffic = Traffic(client, args.name, rng)
        print("soak client running", flush=True)
        end = time.monotonic() + args.seconds
        for n in range(args.max_ops):
            if time.monotonic() >= end or (n % 64 == 0 and os.path.exists(args.stop_file)):
                break
            traffic.step()
    with open(args.out, "w") as out:
        result = traffic.result
        # not asdict(): it rebuilds a Counter from (key, count) pairs, counting the pairs
        json.dump({**vars(result), "ops": dict(result.ops), "errors": dict(result.errors)}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
