#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
