"""The container image (the repository's Dockerfile) as Compose builds it.

Every run checks what the Dockerfile's steps rely on, on this machine: what it copies is
in the build context, the Debian packages it installs exist, and they hold every system
library Mooncake's wheel loads (found with ldd; libcurl4 was missing once).  A slow test
builds the image for real with podman FROM a Debian made here (mmdebstrap), checks that
no layer ships the wheel, and runs `kvpool --version`, Mooncake's import and a `kvpool
master` that a client uses.  scripts/setup.sh installs podman, runc and mmdebstrap.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import subprocess
import tarfile
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool import Client
from kvpool.testing.processes import PoolProcess
from tests.deploy.wheel_build import ROOT, SOURCES

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
# in every Debian image besides the Dockerfile's packages: apt (which the Dockerfile runs)
# and what it needs (libc6, libstdc++6, ...)
ALWAYS_THERE = ("apt",)


@dataclass(frozen=True)
class Step:
    """One instruction of the Dockerfile: ``RUN``, ``COPY`` ... and its text."""

    instruction: str
    text: str


def steps() -> list[Step]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    lines = [
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            instruction, _, text = line.strip().partition(" ")
            found.append(Step(instruction.upper(), " ".join(text.split())))
    return found


def apt_packages() -> list[str]:
    """The packages of the Dockerfile's ``apt-get install`` steps."""
    packages: list[str] = []
    for step in steps():
        for install in re.findall(r"apt-get install ([^&;|]*)", step.text):
            packages += [w for w in install.split() if not w.startswith("-")]
    return packages


def arg_default(name: str) -> str:
    (text,) = [s.text for s in steps() if s.instruction == "ARG" and s.text.startswith(name + "=")]
    return text.partition("=")[2]


# ------------------------------------------------------------------------ the Dockerfile
def test_dockerfile_runs_kvpool_and_compose_builds_it() -> None:
    entrypoint = [s.text for s in steps() if s.instruction == "ENTRYPOINT"]
    assert entrypoint == ['["kvpool"]']
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        build = service["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        assert "example.com" not in service["image"], name  # a local name, built here


def matches(pattern: str, path: str) -> bool:
    """A .dockerignore pattern matches a path or a folder above it, one segment per
    segment (``*`` stays within one); ``**/`` matches any folders in front."""
    parts = path.split("/")
    anywhere = pattern.startswith("**/")
    want = pattern.removeprefix("**/").split("/")
    for end in range(1, len(parts) + 1):
        starts = range(end) if anywhere else range(1)
        for start in starts:
            got = parts[start:end]
            if len(got) == len(want) and all(map(fnmatch.fnmatchcase, got, want)):
                return True
    return False


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern that matches the path decides."""
    verdict = False
    for pattern in patterns:
        if matches(pattern.removeprefix("!"), path):
            verdict = not pattern.startswith("!")
    return verdict


def test_dockerfile_copies_what_the_wheel_is_made_of() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied: list[str] = []
    for step in steps():
        if step.instruction == "COPY" and "--from=" not in step.text:
            copied += step.text.split()[:-1]
    # the same files as the wheel test builds from, all of them in the build context
    assert sorted(copied) == sorted(SOURCES)
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not ignored(source, patterns), f"{source} is left out by .dockerignore"
    assert ignored(".venv", patterns) and ignored("kvpool/__pycache__/x.pyc", patterns)
    assert not ignored("kvpool/master/static/status.html", patterns)


def test_dockerfile_extras_are_the_wheels() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert arg_default("EXTRAS") in extras["optional-dependencies"]
    assert arg_default("BASE").startswith("debian:bookworm")


needs_apt = pytest.mark.skipif(
    not (shutil.which("apt-cache") and shutil.which("dpkg")), reason="not a Debian machine"
)


@needs_apt
def test_dockerfile_apt_packages_exist() -> None:
    packages = apt_packages()
    assert {"python3", "python3-venv", "libibverbs1", "libnuma1"} <= set(packages)
    done = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", *packages],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    shown = set(re.findall(r"^Package: (\S+)$", done.stdout, flags=re.MULTILINE))
    assert shown == set(packages), set(packages) - shown


def system_libraries(binaries: list[Path]) -> set[str]:
    """The libraries outside the Python environment that ``binaries`` load (ldd)."""
    found: set[str] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30).stdout
        assert "not found" not in out, f"{binary}: {out}"
        for lib in re.findall(r"=> (/\S+)", out):
            if "site-packages" not in lib and ".libs/" not in lib:
                found.add(lib)
    return found


def owning_packages(paths: set[str]) -> dict[str, str]:
    """The Debian package of each library, whichever side of Debian's /usr merge dpkg
    knows it by (one dpkg call: each one reads the whole database)."""

    def other(path: str) -> str:
        return path.removeprefix("/usr") if path.startswith("/usr/") else "/usr" + path

    asked = sorted(paths | {other(p) for p in paths})
    out = subprocess.run(["dpkg", "-S", *asked], capture_output=True, text=True).stdout
    owner = {}
    for line in out.splitlines():
        packages, _, path = line.partition(": ")
        owner[path] = packages.split(",")[0].split(":")[0]
    missing = sorted(p for p in paths if p not in owner and other(p) not in owner)
    assert not missing, f"no Debian package holds {missing}"
    return {p: owner.get(p) or owner[other(p)] for p in paths}


def closure(packages: list[str]) -> set[str]:
    """``packages`` and everything they depend on, as the image's apt-get installs it."""
    flags = ["--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks"]
    flags += ["--no-replaces", "--no-enhances"]
    out = subprocess.run(
        ["apt-cache", "depends", "--recurse", *flags, *packages],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return {line.split(":")[0] for line in out.splitlines() if line and not line[0].isspace()}


@needs_apt
def test_dockerfile_installs_every_library_mooncake_loads() -> None:
    mooncake = pytest.importorskip("mooncake")  # the `mooncake` extra (scripts/setup.sh)
    package = Path(mooncake.__file__).parent
    binaries = [*package.glob("*.so"), *package.parent.glob("mooncake_*.libs/*.so*")]
    binaries += [p for p in (package / "mooncake_master",) if p.exists()]
    assert any(b.name.startswith("store") for b in binaries), binaries
    have = closure(apt_packages() + list(ALWAYS_THERE))
    owners = owning_packages(system_libraries(binaries))
    missing = {lib: pkg for lib, pkg in sorted(owners.items()) if pkg not in have}
    assert not missing, f"add these Debian packages to the Dockerfile: {missing}"


# ------------------------------------------------------------------ the image, for real
BASE_TAG = "localhost/kvpool-test-base:bookworm"
IMAGE_TAG = "localhost/kvpool:test"


class Podman:
    """podman with a configuration this machine can run: runc (crun refuses hybrid
    cgroups: "cgroups in hybrid mode not supported") and limits under this machine's, which
    a root without CAP_SYS_RESOURCE may set (podman's default of 1048576 open files is
    refused: "setrlimit `RLIMIT_NOFILE`: Operation not permitted")."""

    def __init__(self, folder: Path) -> None:
        self.conf = folder / "containers.conf"
        runtime = 'runtime = "runc"\n' if shutil.which("runc") else ""
        self.conf.write_text(
            '[containers]\ndefault_ulimits = ["nofile=4096:4096", "nproc=16384:16384"]\n'
            f"[engine]\n{runtime}"
        )
        self.env = {"CONTAINERS_CONF": str(self.conf)}

    def __call__(self, *argv: str, timeout: float = 120) -> str:
        done = subprocess.run(
            ["podman", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, **self.env),
        )
        assert done.returncode == 0, f"podman {argv}: {done.returncode}\n{done.stderr[-4000:]}"
        return done.stdout

    def exists(self, image: str) -> bool:
        argv = ["podman", "image", "exists", image]
        return subprocess.run(argv, env=dict(os.environ, **self.env)).returncode == 0


def base_image(podman: Podman, folder: Path) -> str:
    """A Debian bookworm image: KVPOOL_TEST_BASE_IMAGE, else one made here with mmdebstrap
    from Debian's mirror (kept for the next run).  The machine's own CA certificates go in,
    as a site's base image carries its own, for pip behind a TLS-inspecting proxy."""
    if name := os.environ.get("KVPOOL_TEST_BASE_IMAGE"):
        return name
    if podman.exists(BASE_TAG):
        return BASE_TAG
    if not shutil.which("mmdebstrap"):
        pytest.fail(
            "mmdebstrap is not installed; it makes the image's Debian base. Run "
            "scripts/setup.sh (it installs Debian's), apt-get install mmdebstrap, "
            "or name a Debian bookworm image in KVPOOL_TEST_BASE_IMAGE"
        )
    rootfs = folder / "bookworm.tar"
    hooks = []
    if any(Path("/usr/local/share/ca-certificates").glob("*.crt")):
        hooks = ["--customize-hook=copy-in /usr/local/share/ca-certificates /usr/local/share"]
    subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--quiet", *hooks, "bookworm", str(rootfs)],
        check=True,
        timeout=900,
    )
    podman("import", "--quiet", str(rootfs), BASE_TAG, timeout=300)
    rootfs.unlink()
    return BASE_TAG


def layer_files(podman: Podman, image: str, folder: Path) -> list[str]:
    """The paths in every layer of ``image``, as a push or a save ships them: a file
    that a later layer deletes is still in the layer that added it."""
    saved = folder / "saved"
    podman("image", "save", "--quiet", "--format", "oci-dir", "--output", str(saved), image,
           timeout=300)  # fmt: skip
    blobs = saved / "blobs" / "sha256"

    def blob(digest: str) -> Path:
        return blobs / digest.removeprefix("sha256:")

    (entry,) = json.loads((saved / "index.json").read_text())["manifests"]
    manifest = json.loads(blob(entry["digest"]).read_text())
    names: list[str] = []
    for layer in manifest["layers"]:
        with tarfile.open(blob(layer["digest"])) as tar:  # compressed or not
            names += tar.getnames()
    shutil.rmtree(saved)  # the whole image: too big to keep in pytest's folders
    return names


@contextlib.contextmanager
def container_master(podman: Podman) -> Iterator[PoolProcess]:
    """``kvpool master`` in the image, on the host's network as in Compose; a /dev/shm of
    its own, big enough for the segment (the Compose file gives the host's)."""
    name = f"kvpool-test-{uuid.uuid4().hex[:8]}"
    run = ["podman", "run", "--rm", "--name", name, "--network", "host", "--shm-size", "256m"]
    try:
        with PoolProcess(
            ["master", "--host", "127.0.0.1", "--port", "0", "--segment_size", "64MB"],
            program=[*run, IMAGE_TAG],
            env=podman.env,
            ready_timeout_s=60,
        ) as master:
            yield master
    finally:  # podman run passes SIGTERM on; a podman killed on a timeout would not
        subprocess.run(["podman", "rm", "-f", "-t", "5", name], env=dict(os.environ, **podman.env),
                       capture_output=True, timeout=60)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_image_builds_and_serves(tmp_path: Path) -> None:
    if not shutil.which("podman"):
        pytest.fail(
            "podman is not installed; the Dockerfile is built and run for real. Run "
            "scripts/setup.sh (it installs Debian's podman and runc) or apt-get install "
            "podman runc"
        )
    podman = Podman(tmp_path)
    base = base_image(podman, tmp_path)
    old = podman("images", "--quiet", IMAGE_TAG).strip()
    podman("build", "--network", "host", "--build-arg", f"BASE={base}", "--tag", IMAGE_TAG,
           str(ROOT), timeout=1500)  # fmt: skip
    new = podman("images", "--quiet", IMAGE_TAG).strip()
    if old and old != new:  # the last run's image, superseded; its cached layers stay
        with contextlib.suppress(AssertionError):
            podman("rmi", old)
    wheels = [n for n in layer_files(podman, IMAGE_TAG, tmp_path) if n.endswith(".whl")]
    # Debian's python3-venv brings pip's and setuptools' wheels (/usr/share/python-wheels)
    assert not [n for n in wheels if "kvpool-" in n], f"a layer ships the wheel: {wheels}"

    assert podman("run", "--rm", IMAGE_TAG, "--version").strip() == "kvpool 0.1.0"
    probe = "import mooncake.store, kvpool; print(kvpool.__file__)"
    where = podman("run", "--rm", "--entrypoint", "python3", IMAGE_TAG, "-c", probe)
    assert where.strip().startswith("/opt/kvpool/lib/"), where
    with container_master(podman) as master:
        with urllib.request.urlopen(f"http://{master.address}/health", timeout=10) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        with Client(master.address, timeout_s=30) as c:
            c.put("from-the-host", b"kv" * 50_000)
            assert c.get("from-the-host") == b"kv" * 50_000
        assert master.proc.poll() is None
    assert master.proc.returncode == 0, list(master.lines)[-20:]
