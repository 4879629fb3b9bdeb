#!/usr/bin/env bash
# Create .venv with a CPU torch (never a CUDA build) and radixlm installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first, pinned: an unpinned torch requirement would pull several GB of CUDA wheels.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
# Compile the CPU attention op into the user cache (keyed by source, torch and CPU), so the
# engine's first use loads it in < 1 s. Never fails: without a compiler the torch backend is used.
.venv/bin/python -m radixlm.kernels.cpu.build
