#!/usr/bin/env bash
# The test suite. Off a GPU the Pallas kernels run in interpret mode; GPU-only tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
