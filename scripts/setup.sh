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
# SGLang's own client for the compatibility tests (tests/lang/test_sglang_client.py). --no-deps:
# its requirements are SGLang's GPU server (CUDA torch, flashinfer, ...); the few packages its
# frontend imports are in the `test` extra. (`pip check` then lists sglang's unmet server deps.)
.venv/bin/pip install -q --disable-pip-version-check --no-deps "sglang==${SGLANG_VERSION:-0.5.23}"
# Headless Chromium for the dashboard's browser test (tests/server/test_dashboard_browser.py);
# only when missing, and only where apt can run (root). Elsewhere that one test skips, saying why.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        chromium chromium-driver >/dev/null; } \
      || echo "setup: could not install chromium; the dashboard browser test will skip"
  else
    echo "setup: chromium is not installed (needs root + apt); the dashboard browser test will skip"
  fi
fi
# Compile the CPU attention op into the user cache (keyed by source, torch and CPU), so the
# engine's first use loads it in < 1 s. Never fails: without a compiler the torch backend is used.
.venv/bin/python -m radixlm.kernels.cpu.build
# Compile the schema verifier (scanner, trackers, checks, matcher) with mypyc into the same cache
# (keyed by its sources, Python and mypy): loaded in place of the Python modules. Never fails:
# without it the same source runs as Python.
.venv/bin/python -c "from radixlm.runtime.grammar.native import main; main()"
